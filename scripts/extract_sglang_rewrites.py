#!/usr/bin/env python3
"""Extract SGLang's draft-architecture rewrites (ModelConfig._config_draft_model) from unpacked wheels.

Usage: run in a directory holding one folder per release (``0.5.23/sglang/srt/configs/model_config.py``,
unpacked from ``pip download --no-deps sglang==VER``); prints what each release adds or drops and writes
``rewrites.json``. tests/data/sglang_draft_rewrites.json is its output for 0.4.7-0.5.23 (DeepseekV4's
DSpark branch replaced by its EAGLE/NEXTN class); consistency/contract/sglang_drafts.py is checked against it.
"""
import re, sys, pathlib, json
def parse(v):
    p = pathlib.Path(v)/"sglang/srt/configs/model_config.py"
    if not p.exists(): return None
    src = p.read_text()
    consts = {}
    for m in re.finditer(r"^([A-Z_0-9]+)\s*=\s*\(([^)]*)\)", src, re.M):
        consts[m.group(1)] = re.findall(r'"([^"]+)"', m.group(2))
    m = re.search(r"def _config_draft_model\(self\):(.*?)\n    def ", src, re.S)
    if not m:
        # older: inline in __init__
        m = re.search(r"(if\s*\(?\s*is_draft_model.*?)\n\s*# Check model type", src, re.S)
        if not m: return "NOFUNC"
    body = m.group(1)
    out = {}
    # split into if-blocks
    for blk in re.split(r"\n        if ", body):
        cond = blk.split(":\n",1)[0] if ":\n" in blk else blk
        srcs = re.findall(r'"([A-Za-z0-9_]+)"', cond)
        for c in re.findall(r"in ([A-Z_0-9]+)", cond): srcs += consts.get(c, [])
        tgt = re.search(r'architectures\[0\] = "([^"]+)"', blk) or re.search(r'architectures = \["([^"]+)"\]', blk)
        if "is_draft_model" in cond and tgt:
            for s in srcs:
                if s not in ("DSPARK","DSparkMiniMaxDraftModel") and s != tgt.group(1): out.setdefault(s, tgt.group(1))
    return out
vs = sorted([d.name for d in pathlib.Path(".").iterdir() if d.is_dir() and d.name[0]=="0"], key=lambda s: [int(x) if x.isdigit() else 0 for x in s.replace("post",".").split(".")])
res = {v: parse(v) for v in vs}
json.dump(res, open("rewrites.json","w"), indent=1)
prev = {}
for v in vs:
    r = res[v]
    if not isinstance(r, dict): print(v, r); continue
    add = {k: r[k] for k in r if k not in prev or prev[k]!=r[k]}; rem = [k for k in prev if k not in r]
    print(v, "+", add, "-", rem)
    prev = r
