"""Findings for drafts beyond EAGLE-3: the step-0 state and the per-step tensors (docs/findings.md).

compare resolved what each side's ``recycle.k`` holds (``Result.step``); this module turns
that, and three structural checks on the draft's input, into findings:

* ``recycle.k``   d_raw vs d_norm vs the target's state -> RECYCLE_NORM_MISSING / _APPLIED / RECYCLE_TARGET
* ``draft_cat.k`` the embedding and hidden halves swapped -> CONCAT_ORDER (a hypothesis in the registry)
* ``draft_embed.k`` the position-0 row zeroed on one side only -> POS0_EMBED
* ``draft_ids.k`` the ids one row off (another token pairing) -> TOKEN_SHIFT
* ``aux.0`` of a last-state consumer (MTP, EAGLE-1, Medusa): NORM_MISSING / NORM_APPLIED say
  what each side fed and what the runtimes serve (contract/consumers.py)

Root cause first: the draft's tensors run in a fixed forward order (step k's ids,
embedding, hidden input, concatenation, output; then step k+1), so a difference that only
follows from an earlier one is PROPAGATED.
"""

from __future__ import annotations

import numpy as np

from consistency.compare.engine import Comparison, Result, Status
from consistency.compare.identify import token_distance
from consistency.compare.expect import LAST_STATE
from consistency.compare.steps import step_order
from consistency.compare.types import Source
from consistency.contract import consumers
from consistency.contract.codes import C
from consistency.contract.findings import Finding, with_property
from consistency.contract.models import ConcatOrder, Consumer, NormState, Pos0, Recycle
from consistency.diagnose.rootcause import fold_consequences
from consistency.diagnose.evidence import Evidence, Explanation
from consistency.dump import names

CONSEQUENCE_CODES = tuple(sorted(with_property("consequence", "step")))
MAX_IDS = 10_000_000
SHIFTS = (-1, 1, -2, 2)


def _codes(rows: list[consumers.ConsumerRow], limit: int = 4) -> str:
    out = ", ".join(r.code for r in rows[:limit])
    return out + (f", ... ({len(rows)} rows)" if len(rows) > limit else "")


def _bounded(text: str, limit: int = 200) -> str:
    """A consumer's ``source`` may come from a reference file: keep it to one short line."""
    one = " ".join(str(text).split())
    return one if len(one) <= limit else one[:limit] + "..."


def _kind(cmp: Comparison) -> Consumer | None:
    return cmp.plan.consumer.kind if cmp.plan.consumer is not None else None


def _origin(cmp: Comparison) -> str:
    c = cmp.plan.consumer
    if c is None:
        return ""
    who = "reference metadata" if cmp.plan.consumer_source == Source.ref_claim else "contract"
    return f"the {who}'s {c.kind.value} consumer"


def _side(cmp: Comparison, which: str) -> str:
    meta = (cmp.cand if which == "cand" else cmp.ref).metadata
    if meta and meta.side in ("training", "serving"):
        return meta.side
    return "candidate" if which == "cand" else "reference"


def explain_step(ev: Evidence, r: Result, label: str, base: dict, metrics: dict) -> Finding | None:
    """A per-step draft tensor that differs: the structural explanation, or None."""
    kind = r.identity.kind
    if r.ref is None or r.status in (Status.ok, Status.unpaired, Status.unverified, Status.empty, Status.nonfinite):
        return None
    test = {names.RECYCLE: _recycle, names.DRAFT_EMBED: _pos0, names.DRAFT_IDS: _ids}.get(kind)
    return test(ev, r, label, base, metrics) if test is not None else None


_WHAT = {Recycle.d_norm: "the draft's step {j} output after its own final norm (d_norm)",
         Recycle.d_raw: "the draft's step {j} output before its own final norm (d_raw)",
         Recycle.target: "the target's hidden state"}


def _recycle(ev: Evidence, r: Result, label: str, base: dict, metrics: dict) -> Finding | None:
    st, cmp = r.step, ev.cmp
    if st is None or st.cand_kind is None:
        return None
    want = st.rule  # the reference's own recycle, else its consumer's, else the contract's (compare.steps)
    if want is None or want == st.cand_kind:
        return None
    code = {(Recycle.d_raw, Recycle.d_norm): C.RECYCLE_NORM_MISSING,
            (Recycle.d_norm, Recycle.d_raw): C.RECYCLE_NORM_APPLIED}.get((st.cand_kind, want), C.RECYCLE_TARGET)
    k = r.identity.index or 0
    ref_what = _WHAT[want].format(j=k - 1)
    msg = f"{label} (the hidden state step {k} is fed) is {_WHAT[st.cand_kind].format(j=k - 1)} ({st.cand_source}); "
    if st.rule_source == Source.ref_values:
        msg += f"{_side(cmp, 'ref')} recycles {ref_what} ({st.ref_source})"
    else:
        msg += f"{_origin(cmp)} recycles {ref_what}"
    spec = cmp.plan.consumer
    ev_d = {"before": _num(ev.before(r)), "after": _num(st.distances.get(st.cand_source or "")),
            "holds": st.cand_source, "reference_holds": st.ref_source, "recycle": st.cand_kind.value,
            "expected_recycle": want.value, "rule_from": st.rule_source.value,
            "distances": {k: _num(v) for k, v in st.distances.items()},
            "consumer_source": _bounded(spec.source) if spec is not None and spec.source else None}
    return Finding.make(code, msg, identified_as=(st.cand_source or "").split(":")[-1].split("[")[0] or None,
                        metrics=metrics, evidence=ev_d, **base)


def _num(v: float | None) -> float | None:
    """Evidence goes into strict JSON: finite numbers only, 4 significant digits."""
    return float(f"{v:.4g}") if v is not None and np.isfinite(v) else None


def concat_order(ev: Evidence, r: Result) -> Explanation | None:
    """A hypothesis (diagnose/hypotheses.py REGISTRY): ``draft_cat.k`` is the reference's
    concatenation with its embedding and hidden halves swapped."""
    if r.identity.kind != names.DRAFT_CAT:
        return None
    c, e, before = ev.cand(r), ev.expected(r), ev.before(r)
    if c is None or e is None or before is None or c.shape[1] % 2:
        return None
    h = c.shape[1] // 2
    after = token_distance(c, np.concatenate([e[:, h:], e[:, :h]], axis=1))
    spec = ev.cmp.plan.consumer
    by_order = {o: [x for x in consumers.ROWS if x.concat_order == o and x.method in (Consumer.mtp, Consumer.eagle1)]
                for o in ConcatOrder}
    if spec is not None:
        want = spec.concat_order
        got = ConcatOrder.hidden_embed if want == ConcatOrder.embed_hidden else ConcatOrder.embed_hidden
        head = f"holds [{got.value.replace(',', ', ')}] where {_side(ev.cmp, 'ref')} concatenates " \
               f"[{want.value.replace(',', ', ')}] ({_origin(ev.cmp)})"
    else:
        head = "is the reference's concatenation with its two halves swapped"
    msg = f"{head}: [hidden, embed] is the order of {_codes(by_order[ConcatOrder.hidden_embed])}; [embed, hidden] " \
          f"of {_codes(by_order[ConcatOrder.embed_hidden])}"
    return Explanation(C.CONCAT_ORDER, msg, before, after, r.ref.name if r.ref else None, {"half": h})


def _pos0(ev: Evidence, r: Result, label: str, base: dict, metrics: dict) -> Finding | None:
    assert r.ref is not None
    seq = r.cand.shape[-2] if len(r.cand.shape) >= 3 else r.cand.rows
    bad = r.bad_tokens
    if not bad or not seq or any(i % seq for i in bad) or (r.cand.rows, r.cand.cols) != (r.ref.rows, r.ref.cols):
        return None
    c0, e0 = r.cand.take_rows(bad, np.float64), r.ref.take_rows(bad, np.float64)
    cz, ez = not np.any(c0), not np.any(e0)
    if cz == ez:
        return None
    cmp, kind = ev.cmp, _kind(ev.cmp)
    rows = [x for x in consumers.ROWS if kind is None or x.method == kind]
    zeroing = [x for x in rows if x.pos0_embed == Pos0.zeroed]
    keeping = [x for x in rows if x.pos0_embed == Pos0.kept and x.method in (Consumer.mtp, Consumer.eagle1)]
    who, other = (_side(cmp, "cand"), _side(cmp, "ref")) if cz else (_side(cmp, "ref"), _side(cmp, "cand"))
    msg = f"{label}: {who} zeroes the embedding row at position 0 (rows {bad[:8]}), {other} keeps it; zeroing " \
          f"is the rule of {_codes(zeroing) or 'no row of the consumer table'} (vllm deepseek_mtp.py: " \
          f"inputs_embeds[positions == 0] = 0), keeping it of {_codes(keeping) or 'none'}"
    spec = cmp.plan.consumer
    if spec is not None:
        msg += f"; {_origin(cmp)} says {spec.pos0_embed.value}"
    return Finding.make(C.POS0_EMBED, msg, metrics=metrics,
                        evidence={"rows": bad[:64], "zeroed_by": "candidate" if cz else "reference"}, **base)


def _ids(ev: Evidence, r: Result, label: str, base: dict, metrics: dict) -> Finding | None:
    assert r.ref is not None
    if r.cand.is_float or r.ref.is_float or max(r.cand.numel, r.ref.numel) > MAX_IDS:
        return None
    c, e = r.cand.read_all().reshape(-1), r.ref.read_all().reshape(-1)
    found = None
    for d in SHIFTS:
        lo, hi = max(0, -d), min(len(c), len(e) - d)
        if hi - lo < 2:
            continue
        same = float(np.mean(c[lo:hi] == e[lo + d:hi + d]))
        if same >= 0.99 and (found is None or same > found[1]):
            found = (d, same)
    if found is None:
        return None
    d, _ = found
    k = r.identity.index or 0
    pc, pr = _pairing(ev, "cand", c, k), _pairing(ev, "ref", e, k)
    msg = f"{label}: row r holds the reference's row r{d:+d}"
    if pc is not None and pr is not None:
        msg += f": {_side(ev.cmp, 'cand')} pairs {_pair_words(pc)}; {_side(ev.cmp, 'ref')} pairs {_pair_words(pr)}"
    spec = ev.cmp.plan.consumer
    if spec is not None:
        msg += f"; {_origin(ev.cmp)} pairs by '{spec.pairing.value}'"
    return Finding.make(C.TOKEN_SHIFT, msg, metrics=metrics,
                        evidence={"shift": d, "pairing_candidate": pc, "pairing_reference": pr}, **base)


def _pairing(ev: Evidence, side: str, ids: np.ndarray, k: int) -> int | None:
    """j when row r of step k's ids is token r+k+j of the side's ``input_ids`` (1: shift pairing)."""
    full = ev.input_ids(side)
    if full is None:
        return None
    for o in range(0, k + 4):
        n = min(len(ids), len(full) - o)
        if n >= 2 and np.array_equal(ids[:n], full[o:o + n]):
            return o - k
    return None


def _pair_words(j: int) -> str:
    if j == 1:
        return "hidden t with token t+1 (the shift pairing of EAGLE and MTP)"
    if j == 0:
        return "hidden t with token t (no shift, as a DFlash block)"
    return f"hidden t with token t{j:+d}"


# An MTP / EAGLE-1 / Medusa draft reads fnorm(s=N) in every runtime (contract/consumers.py),
# so the registry's generic fix ("capture the pre-norm stream") would point at the wrong side.
LAST_STATE_FIX = {
    C.NORM_APPLIED: "the candidate feeds what every runtime serves (fnorm(s=N)); train the draft on it too: apply the "
                    "target's final norm to a layer-N capture before training (speculators MTP and ModelOpt offline "
                    "EAGLE-1 train on vLLM's pre-norm layer-N capture)",
    C.NORM_MISSING: "feed the draft the tensor the target's lm_head reads (after the final norm), as SGLang, vLLM and "
                    "TensorRT-LLM do for MTP and EAGLE-1 drafts",
}


def annotate_step0(cmp: Comparison, findings: list[Finding]) -> list[Finding]:
    """Say what each side fed at step 0 when the draft reads the target's last state (a
    reference whose aux.0 contradicts a post-norm contract is a CONTRACT_CONFLICT already)."""
    kind = _kind(cmp)
    slot0 = next((e for e in cmp.plan.slots if e.slot == 0), None)
    if kind not in LAST_STATE and not (slot0 is not None and slot0.expect.post_norm):
        return findings
    n = (slot0.expect.stream if slot0 is not None else None) or _n(cmp)
    words = step0_words(kind) if kind is not None else ""
    ref_held = cmp.ref_slot_names[0] if cmp.ref_slot_names else None
    fed = {C.NORM_MISSING: f"stream {n} before the final norm", C.NORM_APPLIED: f"fnorm(s={n})"}
    for f in findings:
        if f.tensor == names.aux(0) and f.code in fed:
            ref_fed = fed[C.NORM_MISSING] if ref_held == names.hidden(n or -1) else \
                fed[C.NORM_APPLIED] if ref_held == names.FINAL_NORM else None
            f.message += f" -- {_side(cmp, 'cand')} fed {fed[f.code]}" + \
                (f"; {_side(cmp, 'ref')} fed {ref_fed}" if ref_fed else "") + (f"; {words}" if words else "")
            if kind in LAST_STATE:  # the runtimes agree on fnorm(s=N): the fix is on whichever side differs
                f.fix = LAST_STATE_FIX[f.code]
    return findings


def _n(cmp: Comparison) -> int | None:
    return cmp.plan.num_layers if cmp.plan.num_layers is not None else cmp.plan.cand.num_layers


def step0_words(kind: Consumer) -> str:
    """What the consumer table says about step 0 for this method, in one clause."""
    rows = consumers.rows(kind)
    serving = [r for r in rows if r.side == "serving"]
    post = [r for r in serving if r.step0_norm == NormState.final_norm]
    pre_train = [r for r in rows if r.side == "training" and r.step0_norm == NormState.none]
    out = []
    if serving and len(post) == len(serving):
        out.append(f"every runtime serves fnorm(s=N) to {kind.value} drafts ({_codes(post)})")
    elif post:
        out.append(f"{_codes(post)} serve fnorm(s=N)")
    for r in pre_train:
        out.append(f"{r.code} trains on stream N before the final norm ({r.note or r.source})")
    return "; ".join(out)


HIDDEN_INPUT_CODES = with_property("hidden_input")
ECHO_CODES = with_property("echo")
UNCHECKED = with_property("unchecked")  # not a divergence: never a root


def group_steps(cmp: Comparison, findings: list[Finding]) -> list[Finding]:
    """Later draft tensors that differ without a cause of their own follow the first
    failing one in the draft's forward order (``aux.0`` is step 0's hidden input)."""
    shifted = {names.parse(f.tensor or "").index for f in findings
               if f.code == C.TOKEN_SHIFT and names.parse(f.tensor or "").kind == names.DRAFT_IDS}

    def follows(f: Finding, root: Finding) -> bool:
        o = _order(f)
        kind = names.parse(f.tensor or "").kind
        if f.code in CONSEQUENCE_CODES:
            return True
        if f.code == C.TOKEN_SHIFT and o is not None and o[0] in shifted and kind == names.DRAFT_EMBED:
            return True
        # A wrong hidden input (aux.0 or recycle.k) reappears in what the draft computes from it:
        # an EAGLE-1 draft_cat is cat(emb, h) with no input norm, so its hidden half "is" the
        # wrong state, and a later output can look shifted. One cause, reported once.
        return root.code in HIDDEN_INPUT_CODES and names.parse(root.tensor or "").kind in (names.AUX, names.RECYCLE) \
            and kind in (names.DRAFT_CAT, names.DRAFT_OUT, names.DRAFT_NORM) and f.code in ECHO_CODES

    return fold_consequences(findings, _order, follows, _where, scope="draft tensor",
                             consequence_codes=CONSEQUENCE_CODES, root_ok=lambda f: f.code not in UNCHECKED)


def _order(f: Finding) -> tuple[int, int] | None:
    """Where a finding sits in the draft's forward order; the reference's own step-0 input
    (a finding about what training fed) sits where ``aux.0`` does."""
    return step_order(f.tensor if f.tensor is not None else f.evidence.get("reference_tensor"))


def _where(f: Finding) -> str:
    return f.tensor or f"reference {f.evidence.get('reference_tensor', '?')}"


def recycle_claims(cmp: Comparison) -> list[Finding]:
    """The reference's own recycle (its ``recycle.k`` against its ``draft_norm``/``draft_out``)
    against what its metadata's consumer (REF_CLAIM_CONTRADICTED, a warning) or the user's
    declaration (CONTRACT_CONFLICT) says: the values win, and the other source is named once."""
    spec = cmp.plan.consumer
    if spec is None or spec.recycle not in (Recycle.d_norm, Recycle.d_raw, Recycle.target):
        return []
    for r in sorted((r for r in cmp.results if r.step is not None), key=lambda r: step_order(r.name) or (0, 0)):
        st = r.step
        if st.ref_kind is None or st.rule_source != Source.ref_values or st.ref_kind == spec.recycle:
            continue
        k = r.identity.index or 0
        claim = cmp.plan.consumer_source == Source.ref_claim
        who = "the reference's metadata" if claim else "the declared"
        msg = (f"{who} {spec.kind.value} consumer recycles {spec.recycle.value}, but the reference's own "
               f"{r.name} is {_WHAT[st.ref_kind].format(j=k - 1)} ({st.ref_source}): its values are used")
        return [Finding.make(C.REF_CLAIM_CONTRADICTED if claim else C.CONTRACT_CONFLICT, msg, tensor=None,
                             evidence={"tensor": r.name, "claimed": spec.recycle.value, "values": st.ref_kind.value,
                                       "holds": st.ref_source, "winner": Source.ref_values.value})]
    return []
