"""The finding-code registry: every code as one row of data (:class:`CodeSpec`).

A row holds everything about a code: its default severity, a one-line title, the fix a user
should apply, where the rule comes from, and the properties later stages ask about (is it a
consequence of an earlier divergence, can a context difference alone cause it, does it lead
the headline, ...), so docs/findings.md (generated from these rows:
``python -m consistency.contract.codes_doc``), the JSON report and the terminal report never
disagree about what a code means, and no module keeps its own list of codes.

Code emits a finding through the constants in :data:`C` (``Finding.make(C.LAYER_MISMATCH, ...)``),
generated from the rows: a misspelt code is an AttributeError, and tests/project/test_architecture.py
fails on any code literal in the package that is not a row (docs/architecture.md, "Adding a
finding code or a lint rule").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

DOCS_URL = "docs/findings.md"


class Severity(str, Enum):
    error = "error"
    warning = "warning"
    info = "info"


@dataclass(frozen=True)
class CodeSpec:
    code: str
    severity: Severity
    title: str
    fix: str
    source: str = ""  # an upstream PR/issue, or the document that states the rule (never empty: a test checks)
    consequence: tuple[str, ...] = ()  # scopes where it may follow an earlier divergence ("stream", "step")
    context_sensitive: bool = False  # a context difference alone can cause it (demoted when contexts differ)
    hidden_input: bool = False  # a wrong hidden state fed to a draft step (its echoes downstream fold into it)
    echo: bool = False  # how a wrong hidden input reappears in what the draft computes from it
    unchecked: bool = False  # says something was not checked: never a root cause
    leads: bool = False  # changes how every other finding reads: it leads the headline

    @property
    def doc(self) -> str:
        return f"{DOCS_URL}#{self.code.lower().replace('_', '-')}"


_E, _W, _I = Severity.error, Severity.warning, Severity.info

ROWS: tuple[CodeSpec, ...] = (
    CodeSpec("OK", _I, "values agree within the noise floor of their dtypes", "nothing to do",
         source="docs/tolerance.md: the noise model (dtype floor, neighbour gap)"),
    CodeSpec("MISMATCH", _E, "values differ beyond the noise floor and no explanation was tested",
         "run compare with diagnosis (default) or inspect the tensor", source="torch.testing.assert_close: how many "
         "elements, how far, where", consequence=("stream", "step"), context_sensitive=True),
    CodeSpec("LAYER_MISMATCH", _E, "the slot holds another stream than the one expected",
         "feed the draft the stream it was trained on: fix the aux layer ids in the draft config or the capture point",
         source="conventions.md: who means what by layer id", context_sensitive=True, hidden_input=True, echo=True),
    CodeSpec("ORDER_MISMATCH", _E, "the slots hold the expected streams in another order",
         "capture in the trained order (ascending by layer unless the contract says otherwise)",
         source="conventions.md: slot order is the capture order, ascending by layer", context_sensitive=True),
    CodeSpec("SLOT_SHIFT", _E, "the slot list is shifted by whole slots (a stream dropped at one end, one added at "
         "the other)", "capture the missing stream (often the embedding, stream 0) and drop the extra one",
         source="seed story: cat([embed, l3, l31]) vs [l3, l31, l59]", context_sensitive=True),
    CodeSpec("LAYER_OFFSET", _E, "every slot is off by the same number of layers (the SGLang +1 family)",
         "write the ids in the serving runtime's convention (see `consistency lint`), or pin the runtime version",
         source="sglang PR #25454; vllm PR #43671", context_sensitive=True),
    CodeSpec("RESIDUAL_MISSING", _E, "the slot is a block's delta, not the residual stream (hidden_states without + "
         "residual)", "capture `hidden_states + residual` (or `hidden_states if residual is None else hidden_states "
         "+ residual`)", source="conventions.md: fused residual", context_sensitive=True),
    CodeSpec("NORM_APPLIED", _E, "the slot equals the expected stream after a norm (e.g. HF's post-norm last hidden "
         "state)", "capture the pre-norm stream (a hook on the last decoder layer), or apply the same norm on both "
         "sides", source="speculators PR #313", context_sensitive=True, hidden_input=True, echo=True),
    CodeSpec("NORM_MISSING", _E, "the slot is the raw stream where a normed one was expected",
         "apply the final norm where training applied it", source="speculators PR #313; SpecForge PR #879 "
         "(norm_output inverted)", context_sensitive=True, hidden_input=True, echo=True),
    CodeSpec("TOKEN_SHIFT", _E, "the slot matches the expected tensor shifted along the sequence",
         "align positions: check BOS handling, chat template and the off-by-one between hidden states and targets",
         source="SpecForge issue #296", context_sensitive=True, hidden_input=True, echo=True),
    CodeSpec("STALE_ROWS", _E, "some token rows hold the reference's previous row (a step earlier) while the rest "
         "agree", "refresh the buffer before every step: under CUDA graphs, copy each replay's inputs into the "
         "static buffers and clone outputs the next replay overwrites; record graph-safe "
         "(CONSISTENCY_RECORD_GRAPHS=1) and compare against an eager recording to see which graph and replay",
         source="SGLang PR #23037 and #35546 (outputs detached from graph buffers a later replay overwrites); "
         "TensorRT-LLM PR #18207 (stale static input buffers)", context_sensitive=True),
    CodeSpec("ROWS_SWAPPED", _E, "some token rows hold another row of the reference (another request's row at the "
         "same position) while the rest agree", "check the runner's row index between the target's output and the "
         "draft's input (padded batches, request order under CUDA graphs); compare against an eager recording to see "
         "which graph and batch size", source="tests/graph_loop.py padded_row: a row index sending a padded row to a "
         "real request's slot", context_sensitive=True),
    CodeSpec("PARTIAL_SHARD", _E, "a partial result of a parallel group: a tensor-parallel all-reduce or gather, or "
         "an expert-parallel MoE combine, is missing (the slot holds one rank's share of a block's output)",
         "capture after the all-reduce (or all-gather) of the tensor-parallel group and after the MoE combine: a "
         "reduction deferred into the next layer's fused add+norm has not happened yet at the layer boundary",
         source="seed story; vLLM PR #36731; SGLang layers/communicator.py should_fuse_mlp_allreduce_with_next_layer "
         "(the MLP all-reduce fused into the next layer's add+RMSNorm)", context_sensitive=True),
    CodeSpec("SCALE_MISMATCH", _E, "values equal up to a constant factor (e.g. an embedding scale applied on one side)",
         "apply the same scale on both sides (embedding multiplier, sqrt(hidden) in Gemma-style models)",
         source="Gemma-style embedding scale sqrt(hidden_size) (HF modeling_gemma.py)", context_sensitive=True,
         hidden_input=True, echo=True),
    CodeSpec("DTYPE_MISMATCH", _W, "dtypes differ", "none if values agree; otherwise record both sides in the "
         "serving dtype", source="docs/tolerance.md: dtype floors (measured on SmolLM2-135M)"),
    CodeSpec("NUMERIC_DRIFT", _W, "the same tensor, but the error exceeds what its dtypes explain",
         "check quantization, kernels (attention backend, fused ops) and accumulation dtype",
         source="docs/tolerance.md: drift stays within 10x the floor and below half the neighbour gap",
         consequence=("stream", "step"), context_sensitive=True),
    CodeSpec("SHAPE_MISMATCH", _E, "shapes differ and cannot be paired", "record the same tokens and the same hidden "
         "size on both sides", source="docs/format.md: rows x cols of a tensor", consequence=("step",)),
    CodeSpec("NONFINITE", _E, "NaN or Inf values", "find the first layer that produces them; check overflow in fp16",
         source="torch.testing.assert_close (equal_nan=False)"),
    CodeSpec("MISSING", _E, "a tensor the reference (or contract) expects is absent from the candidate",
         "record it on the candidate side too, or, if it was never meant to be compared, leave it "
         "out of the contract (--contract)", source="docs/format.md: names",
         unchecked=True),
    CodeSpec("EXTRA", _I, "the candidate has a tensor the reference lacks", "nothing, unless it was meant to be "
         "compared", source="docs/format.md: names"),
    CodeSpec("UNKNOWN", _E, "nothing in the reference explains the values", "inspect the nearest candidates listed",
         source="docs/findings.md: hypotheses tried, none brought the difference to the floor",
         consequence=("stream", "step"), context_sensitive=True),
    CodeSpec("REPLICA_MISMATCH", _E, "tensor-parallel ranks disagree on a tensor that should be replicated",
         "check the all-reduce and the random state across ranks", source="SGLang debug_utils comparator: "
         "replicated-dims check"),
    CodeSpec("NOTHING_COMPARED", _E, "the two dumps have no tensor in common: nothing could be compared",
         "record the same names on both sides (aux slots, hidden.{s}), or give --contract",
         source="issue 13: a comparison that checked nothing must not pass", unchecked=True),
    CodeSpec("EMPTY", _W, "the tensor has no elements", "record at least one token",
         source="docs/format.md: a tensor with no rows"),
    CodeSpec("METADATA_DIFF", _W, "the dumps' metadata disagree on something that changes values",
         "check runtime, convention and claimed stream ids", source="structured diff of the dumps' metadata, "
         "DeepDiff's tree (diagnose/metadiff.py; docs/format.md)"),
    CodeSpec("LAYOUT_ONLY", _I, "only memory layout differs (stride, contiguity, device, clone vs add)",
         "nothing: layout does not change values (the seed's .clone() suspicion)",
         source="seed story: the .clone() vs hidden_states + residual suspicion"),
    CodeSpec("ACCEPTANCE_DROP", _E, "the draft, replayed on the candidate's aux states, predicts the target worse "
         "than on the reference's", "feed the draft what it was trained on: run `consistency compare` on the same "
         "dumps to see which slot differs", source="seed story (74.7% validation accuracy, ~30% acceptance); vllm PR "
         "#43671; vllm PR #50170"),
    CodeSpec("ACCEPTANCE_LOW", _E, "the draft's predicted acceptance on the candidate is below the required floor",
         "fix what compare reports first; if the dumps agree, the draft itself needs more or better training data",
         source="vllm PR #50170 (1.2% instead of 58.9%)"),
    CodeSpec("REPLAY_INCONCLUSIVE", _E, "replay scored nothing it could judge: no drafted position, or a reference "
         "the draft predicts no better than guessing", "replay longer dumps of text the server generates, with the "
         "draft's own target; check the draft belongs to it", source="issue 34: a reference at chance or zero scored "
         "positions is never PASS", unchecked=True),
    CodeSpec("DRAFT_WEAK", _W, "the draft predicts the target poorly even on the reference: replay cannot tell a "
         "good candidate from a bad one", "check that the draft belongs to this target and that the reference holds "
         "the streams it was trained on", source="NeMo Automodel PR #2447 (d2t lost); speculators PR #313 (targets "
         "without the final norm)"),
    CodeSpec("REPLAY_ESTIMATE", _I, "the dump's tokens are not the target's own greedy continuation, so chained "
         "steps are an estimate", "record the dumps on text the target generated greedily, or use --feed "
         "auto/teacher; step 1 is exact either way", source="docs/replay.md: chained steps on text the target did "
         "not generate"),
    CodeSpec("TOKENS_EXTRA", _W, "the candidate holds tokens the reference lacks (at the start, in the middle or "
         "after its end)", "tokenize the same way on both sides: same chat template, same system prompt, same BOS "
         "handling; tokens after the reference's end (decode steps) are expected and only reported",
         source="SpecForge issue #296 (chat template differed between training and data generation)"),
    CodeSpec("TOKENS_MISSING", _W, "the reference holds tokens the candidate lacks", "record the whole prompt on the "
         "serving side, or record positions so a prefix-cache hit is recognised", source="SpecForge issue #296"),
    CodeSpec("CONTEXT_DIFFERS", _E, "aligned tokens saw different tokens before them on the two sides (a template, "
         "system prompt or BOS difference): every later state differs a little for that reason alone",
         "apply the same chat template, system prompt and BOS on both sides (training data generation and serving); "
         "do not read the resulting drift as a layer or norm problem", source="SpecForge issue #296"),
    CodeSpec("TOKENS_REPLACED", _W, "both sides hold other tokens at the same place: a sampled continuation (at the "
         "end), an edit (in the middle), another preamble (at the start); neither span is compared",
         "nothing for a sampled continuation (the tokens before it are compared); otherwise record both sides on the "
         "same text", source="issue 26: a server sampling another answer from position 30"),
    CodeSpec("NOT_CAPTURED", _I, "reference tokens the candidate had in its context but did not record: a "
         "prefix-cache hit, a token another data-parallel rank holds, a gap its positions jump over",
         "nothing: the tokens after them saw the same context (the candidate's positions or its values show it)",
         source="issue 26: prefix-cache hits with and without positions"),
    CodeSpec("VERIFY_PASSES", _I, "a speculative server's verify passes recomputed rejected drafts: the superseded "
         "rows (and the last pass's unconfirmed or ambiguous ones) were not compared", "nothing: the rows of "
         "accepted tokens are compared; record a request to its end to confirm the last drafts",
         source="SGLang speculative/eagle_worker.py verify (accepted prefix + bonus token); vLLM v1 "
         "rejection_sampler.py"),
    CodeSpec("NO_COMMON_TOKENS", _E, "the two sides share no run of tokens (different prompts): nothing can be "
         "compared", "record both sides on the same prompt (the same input_ids)", source="SGLang 0.5.23's comparator "
         "(--token-aligner smart) reports PASS after comparing 0 tokens (issue 14)"),
    CodeSpec("IDENTIFICATION_AMBIGUOUS", _W, "the slot matches two reference streams almost equally",
         "record more tokens or a longer prompt; near-identical layers cannot be told apart",
         source="docs/tolerance.md: confidence = runner-up distance / match distance", context_sensitive=True),
    # trust on inputs we did not write (issue 13)
    CodeSpec("CAPTURES_DROPPED", _E, "the recorder says it did not record some captures: what they held was not "
         "compared", "give the recorder room (max_host_bytes / ring_bytes; CONSISTENCY_RECORD_GRAPH_BYTES for "
         "CUDA-graph buffers) or record fewer slots or tokens, then record again",
         source="issue 30: graph-buffer budget; consistency/record/async_capture.py bounded host memory",
         unchecked=True, leads=True),
    CodeSpec("TOKEN_INDEX_FALSE", _E, "a tensor's token_index (the anchor of each row) is refuted by values: its "
         "rows belong to other positions of their forward pass, repeat one anchor more often than the file holds "
         "sequences, hold other tokens than their anchors have, or disagree with a row-aligned tensor",
         "record with consistency's recorder (it writes each row's anchor from the pass's positions), or drop the "
         "token_index from the file; the rows are compared by order meanwhile", source="issue 34: anchors are claims "
         "(compare/anchors.py); docs/format.md 'Rows paired by anchor'", leads=True),
    CodeSpec("NOT_VERIFIED", _E, "the slot could not be checked: the reference does not record the stream it should "
         "hold", "record the reference with that stream (record --aux-layers, or every stream), or give a reference "
         "that has it", source="issue 13: an expected stream the reference lacks is never OK", unchecked=True),
    CodeSpec("EXPECTATION_UNKNOWN", _E, "the slot holds a recorded stream, but nothing says which stream it should "
         "hold: it was not verified (the candidate's own claims are compared, never trusted)",
         "give --contract, --layer-ids or a reference with aux slots, so the slot can be verified",
         source="issue 13: a reference with no aux slots", unchecked=True),
    CodeSpec("CONTRACT_CONFLICT", _E, "what the user declares (--contract, --layer-ids, a gate's contract) "
         "contradicts what the reference's own slots hold or claim: the reference's values (else its claims) are used",
         "fix the declaration, or the reference: the draft was trained on what the reference holds",
         source="docs/architecture.md, the evidence model: the reference's values > its claims > a declaration",
         leads=True),
    CodeSpec("REF_CLAIM_CONTRADICTED", _W, "the reference's metadata claims a stream (or a recycle rule) its values "
         "are not: the values are used", "fix the producer's aux.stream_ids (or the norm state, or the consumer, it "
         "records)", source="docs/architecture.md, the evidence model: values over claims"),
    CodeSpec("CAND_CLAIM_CONTRADICTED", _W, "the candidate claims a slot holds a stream (its metadata, or "
         "--cand-layer-ids) its values are not: the values are what was compared", "fix what the serving side states "
         "(its recorder's aux ids or --cand-layer-ids): a claim that disagrees with what the server fed misleads the "
         "next reader", source="docs/architecture.md, the evidence model: the candidate's claims are compared, never "
         "trusted; a conflict is a finding"),
    CodeSpec("SAME_INPUT", _E, "the reference and the candidate are the same file: nothing was verified",
         "compare the training dump with the serving dump (consistency compare TRAIN SERVE)",
         source="issue 24: nothing verified is never PASS", unchecked=True, leads=True),
    CodeSpec("UNMATCHED", _E, "the slot matches no tensor of the reference: it is none of the recorded streams",
         "check what the serving side captures; record every stream on the reference side to identify it",
         source="issue 13: a slot that matches nothing is an error"),
    CodeSpec("BAD_TOKENS", _E, "a few token positions differ far beyond the noise floor while the rest agree",
         "check BOS handling, position 0, padding and the tokens named; EAGLE accepts token by token",
         source="seed story; SpecForge issue #296", consequence=("stream", "step"), context_sensitive=True),
    CodeSpec("ZERO_VALUES", _E, "the slot (or some of its feature columns) is all zeros where the reference is not",
         "check that the capture point is written before it is read (an unfilled buffer) and the shard gather",
         source="docs/findings.md: zeros fit 'a norm with weight 0'; they are reported as zeros", echo=True),
    CodeSpec("AUX_CONCAT_MISMATCH", _E, "the concatenated 'aux' disagrees with the per-slot 'aux.{i}' of the same file",
         "record one of them, or make both come from the same capture: which one did the draft get?",
         source="docs/format.md: 'aux' is cat(aux.{i}, -1)"),
    CodeSpec("TOLERATED", _W, "passes only under a user tolerance: it holds another tensor than the one expected",
         "tighten --tolerance/--threshold or fix the capture; the slot table says what it holds",
         source="issue 13: user tolerances never turn into false identity claims"),
    CodeSpec("PROPAGATED", _W, "later tensors differ as a consequence of an earlier divergence",
         "fix the first divergence (the root cause); these follow from it", source="seed story "
         "(VocabParallelEmbedding all-reduce): one divergence, every later stream differs"),
    CodeSpec("SIDES_SWAPPED", _W, "the reference's metadata says it is the serving side (or the candidate the "
         "training side), or, where no file says, the reference records only aux slots that equal streams the "
         "candidate recorded; an error when both files say so or the values show it (every expected/holds reads "
         "backwards)",
         "pass the training dump first: consistency compare TRAIN SERVE", source="docs/format.md: metadata side "
         "(training/serving)", leads=True),
    # drafts beyond EAGLE-3: the state an MTP / EAGLE-1 draft recycles at steps >= 1, its input (issue 19)
    CodeSpec("RECYCLE_NORM_MISSING", _E, "a draft step >= 1 was fed the draft's own output before its final norm "
         "(d_raw) where the reference recycles it after the norm (d_norm)", "recycle the post-norm draft state (the "
         "tensor the shared head reads): return (logits input, recycled state) from the draft, as vLLM's "
         "model_returns_tuple does", source="vllm PR #45895 (fix), vllm #47448, #46075; ROCm/ATOM #1764 (DeepSeek-R1 "
         "MTP-3 acceptance 61.36% -> 64.56%)", hidden_input=True),
    CodeSpec("RECYCLE_NORM_APPLIED", _E, "a draft step >= 1 was fed the draft's own output after its final norm "
         "(d_norm) where the reference recycles it before the norm (d_raw)", "recycle the pre-norm draft state (h + "
         "residual), as EAGLE-1/2 and EAGLE-3 without norm_output do; or retrain with norm_output",
         source="SafeAILab/EAGLE v1 eagle/model/cnets.py (no final norm); speculators models/eagle3/config.py "
         "norm_output", hidden_input=True),
    CodeSpec("RECYCLE_TARGET", _E, "a draft step >= 1 was fed the target's hidden state where the reference recycles "
         "the draft's own output (or the reverse): chain vs non-chain multi-step drafting",
         "feed step k the state the draft was trained on: its own previous output (chain) or the target's "
         "(non-chain, one MTP layer per step)", source="sglang #18564 (multi-layer MTP chain vs non-chain); "
         "TensorRT-LLM _torch/speculative/mtp.py (MTP vanilla)", hidden_input=True),
    CodeSpec("CONCAT_ORDER", _E, "the draft's input concatenation holds the embedding and the hidden state in the "
         "other order ([hidden, embed] vs [embed, hidden])", "concatenate in the order the draft was trained with "
         "(MiMo: [hidden, embed]; DeepSeek, GLM, Qwen3-Next, EAGLE: [embed, hidden])",
         source="vllm mimo_mtp.py input_proj(cat(h, emb)) vs deepseek_mtp.py eh_proj(cat(emb, h)); speculators #366 "
         "review"),
    CodeSpec("POS0_EMBED", _E, "the embedding row at position 0 is zeroed on one side only",
         "zero (or keep) the position-0 embedding on both sides: vLLM DeepSeek/GLM/MiMo MTP zero it, SGLang "
         "deepseek_nextn.py and Megatron keep it", source="vllm deepseek_mtp.py inputs_embeds[positions == 0] = 0; "
         "sglang deepseek_nextn.py (no masking)"),
    # pipeline stages and DP attention: what merging a layout's rank files finds (issue 16)
    CodeSpec("STAGE_MISSING", _E, "a pipeline stage wrote no rank file: its layers were not recorded",
         "record on every stage (a capture guarded by is_first_rank/is_last_rank records one) and pass every node's "
         "files", source="vLLM PR #45985 (aux states of non-last PP ranks dropped)", leads=True),
    CodeSpec("STAGE_RANGES", _E, "pipeline stages' layer ranges overlap, or leave layers to no stage",
         "declare each stage's global [start_layer, end_layer) as the runtime computes it (parallel.declare)",
         source="docs/parallelism.md: each pipeline stage owns a contiguous layer range (SGLang --pp-size)"),
    CodeSpec("STAGE_OUT_OF_RANGE", _E, "a pipeline stage recorded a stream or layer outside its own layer range",
         "name tensors by the global layer index: start_layer + the index within the stage",
         source="vLLM PR #36731 (enumerate(islice(layers, start, end)) counts from 0)"),
    CodeSpec("STAGE_CONFLICT", _E, "two pipeline stages recorded the same tensor with different values",
         "a stream crossing a stage boundary is a copy: fix the stage whose name is wrong (often a local index)",
         source="vLLM PR #36731"),
    CodeSpec("TOKEN_UNOWNED", _E, "a token is held by no data-parallel rank (DP attention): the merged dump lacks it",
         "record on every DP rank, including ranks whose batch is empty, and declare each rank's tokens",
         source="SGLang --enable-dp-attention: each DP rank holds other requests' tokens (docs/parallelism.md)",
         leads=True),
    CodeSpec("TOKEN_DUPLICATE", _E, "a token is held by two data-parallel ranks (DP attention)",
         "declare each rank's own tokens (rows or request id + position); a token belongs to one DP rank",
         source="SGLang --enable-dp-attention: each DP rank holds other requests' tokens (docs/parallelism.md)"),
)


class _Constants:
    """One attribute per code, its value the code itself (``C.OK == "OK"``), read-only."""

    def __init__(self, names: tuple[str, ...]) -> None:
        for n in names:
            object.__setattr__(self, n, n)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"finding codes are rows of consistency/contract/codes.py, not attributes ({name})")

    def __getattr__(self, name: str) -> str:  # only called for names that are not codes
        raise AttributeError(f"{name} is not a finding code (consistency/contract/codes.py)")


def registry(rows: tuple[CodeSpec, ...]) -> tuple[dict[str, CodeSpec], _Constants]:
    """The table and the constants a tuple of rows makes (one code, one row)."""
    table = {c.code: c for c in rows}
    if len(table) != len(rows):
        codes = [c.code for c in rows]
        raise ValueError(f"a finding code has two rows: {sorted({x for x in codes if codes.count(x) > 1})}")
    return table, _Constants(tuple(table))


CODES, C = registry(ROWS)


def with_property(prop: str, scope: str | None = None) -> frozenset[str]:
    """The codes that have a property (for ``consequence``, in the given scope)."""
    if prop == "consequence":
        return frozenset(c.code for c in CODES.values() if scope in c.consequence)
    return frozenset(c.code for c in CODES.values() if getattr(c, prop))


def lookup(code: str) -> CodeSpec:
    return CODES[code]
