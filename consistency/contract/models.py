"""The aux-hidden-state contract and dump metadata, as Pydantic models.

One canonical unit everywhere: the *stream index* s (0..N), the residual stream after s
decoder layers, before any final norm. Runtime-native layer ids are kept beside it only
to say where a stream id came from; every comparison is done in stream indices.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

FORMAT_NAME = "consistency-dump"
FORMAT_VERSION = 1
CONTRACT_VERSION = 1


class Residual(str, Enum):
    """Whether a captured tensor is the full residual stream or only a block's delta."""

    stream = "stream"  # hidden_states + residual (or an HF layer output)
    delta = "delta"  # hidden_states alone in a fused-residual runtime: the MLP's output


class NormState(str, Enum):
    none = "none"  # pre-norm stream
    final_norm = "final_norm"  # the target's final norm applied (HF's last hidden state)
    other = "other"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, defer_build=True)


class RuntimeInfo(Strict):
    name: str | None = Field(None, description="Producer runtime: transformers, sglang, vllm, speculators, specforge, ...")
    version: str | None = None


class ModelInfo(Strict):
    name: str | None = None
    architecture: str | None = Field(None, description="HF architecture, e.g. LlamaForCausalLM")
    num_layers: int | None = Field(None, ge=1, le=100_000, description="N, the number of decoder layers")
    hidden_size: int | None = Field(None, ge=1)
    vocab_size: int | None = Field(None, ge=1)
    dtype: str | None = None


class ShardSpec(Strict):
    """How a tensor-parallel rank's tensor relates to the full tensor (SGLang: ``h[tp]``, ``tp:partial``)."""

    kind: Literal["replicated", "split", "partial"]
    dim: int | None = Field(None, description="Sharded dimension for kind=split (negative counts from the end)")
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    group: str = "tp"

    @model_validator(mode="after")
    def _check(self) -> ShardSpec:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} >= world_size {self.world_size}")
        if self.kind == "split" and self.dim is None:
            raise ValueError("a split shard needs dim")
        return self


class GraphTag(Strict):
    """Where a capture recorded from a CUDA-graph replay came from (consistency/record/graphs.py)."""

    label: str | None = Field(None, description="The graph: its runtime runner, e.g. 'sglang.CudaGraphRunner'")
    batch_size: int | None = Field(None, description="The graph's (padded) batch size")
    real_batch_size: int | None = Field(None, description="Requests really in the batch at this replay")
    tokens: int | None = Field(None, description="The graph's (padded) token rows")
    real_tokens: int | None = Field(None, description="Token rows really in the batch at this replay")
    replay: int | None = Field(None, ge=1, description="Replay number of this graph, from 1")
    rows: int | None = Field(None, description="Rows of the graph's buffer (padded)")
    kept: int | None = Field(None, description="Rows kept after trimming the padding; None: not trimmed")


class TensorMeta(Strict):
    dtype: str | None = Field(None, description="Original dtype (the file may store bf16 as uint16)")
    shape: list[int] | None = None
    stride: list[int] | None = None
    contiguous: bool | None = None
    device: str | None = None
    producer: str | None = Field(None, description="How it was made, e.g. 'clone', 'add', 'hook'")
    residual: Residual | None = None
    norm: NormState | None = None
    shard: ShardSpec | None = None
    token_index: list[int] | None = Field(None, description="Positions kept when only a subset was recorded")
    graph: GraphTag | None = Field(None, description="Set when recorded from a CUDA-graph replay (graph-safe mode)")


class AuxInfo(Strict):
    """What the producer says it fed (or would feed) the draft."""

    stream_ids: list[int] | None = Field(None, description="Canonical stream indices, slot by slot")
    native_ids: list[int] | None = Field(None, description="Ids as the runtime/config spells them")
    convention: str | None = Field(None, description="Convention that maps native_ids to stream_ids, e.g. sglang@0.5.5")
    residual: Residual = Residual.stream
    norm: NormState = NormState.none


class DumpMetadata(Strict):
    format: Literal["consistency-dump"] = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    side: Literal["training", "serving", "reference", "candidate"] | None = None
    runtime: RuntimeInfo | None = None
    model: ModelInfo | None = None
    aux: AuxInfo | None = None
    rank: int | None = Field(None, ge=0)
    world_size: int | None = Field(None, ge=1)
    tensors: dict[str, TensorMeta] = Field(default_factory=dict)
    created: str | None = None
    tool_version: str | None = None
    prompt: str | None = None
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("format_version")
    @classmethod
    def _supported(cls, v: int) -> int:
        if v > FORMAT_VERSION:
            raise ValueError(f"format_version {v} is newer than this consistency supports ({FORMAT_VERSION})")
        return v


class SlotSpec(Strict):
    stream: int = Field(ge=0, description="Stream index fed in this slot")
    width: int | None = Field(None, ge=1, description="Last-dim width (the target hidden size)")
    dtype: str | None = None
    residual: Residual = Residual.stream
    norm: NormState = NormState.none
    contiguous: bool | None = None


class NativeIds(Strict):
    convention: str = Field(description="Convention name (and optional @version): stream, hf, sglang, vllm, ...")
    ids: list[int] | None = Field(None, description="Ids as written in the config; null means the runtime default")


class Consumer(str, Enum):
    """Which kind of draft reads the target's hidden states (docs/methods.md)."""

    eagle3_aux = "eagle3-aux"  # EAGLE-3/3.1: a concatenation of aux streams, fc to hidden
    mtp = "mtp"  # DeepSeek-V3 style MTP / NextN: enorm(emb), hnorm(h), eh_proj, one block, shared head
    eagle1 = "eagle1"  # EAGLE-1/2, HASS: fc(cat(emb, h)) with the target's last (post-norm) state
    medusa = "medusa"  # heads on the last (post-norm) state, no token input
    dflash = "dflash"  # block drafter: aux streams, no token shift
    p_eagle = "p-eagle"  # parallel EAGLE: depth 0 as EAGLE-3, depths >= 1 a learnable placeholder


class Pairing(str, Enum):
    """How a hidden row is paired with a token embedding at the draft's input."""

    shift = "shift"  # hidden at t with emb(x_{t+1}), predicts x_{t+2}; positions stay t (EAGLE, MTP)
    none = "none"  # hidden at t with token t (DFlash: the block starts at the last verified token)
    no_token = "no_token"  # no token input at all (Medusa heads)


class Pos0(str, Enum):
    """The draft's embedding row at position 0."""

    kept = "kept"
    zeroed = "zeroed"  # vLLM DeepSeek/GLM/MiMo MTP: inputs_embeds[positions == 0] = 0


class Recycle(str, Enum):
    """What a multi-step draft is fed as its hidden state at steps >= 1."""

    d_norm = "d_norm"  # the draft's own output after its final norm (MTP shared_head.norm; EAGLE-3.1 norm_output)
    d_raw = "d_raw"  # the draft's own output before its final norm (h + residual)
    target = "target"  # the target's hidden at every step (non-chain multi-layer MTP)
    mask = "mask"  # a learnable placeholder state (P-EAGLE depths >= 1)
    none = "none"  # no later step reads a hidden state (Medusa, a DFlash block)


class ConcatOrder(str, Enum):
    embed_hidden = "embed,hidden"  # DeepSeek, GLM, Qwen3-Next MTP, EAGLE-1/3, TRT-LLM
    hidden_embed = "hidden,embed"  # MiMo MTP (input_proj(cat(h, emb)))


class ConsumerSpec(Strict):
    """How the draft consumes what it is fed, beyond which streams: the parts of the contract
    that differ between speculative methods (conventions-beyond-eagle3.md, section 7)."""

    kind: Consumer = Consumer.eagle3_aux
    pairing: Pairing = Pairing.shift
    pos0_embed: Pos0 = Pos0.kept
    recycle: Recycle = Field(Recycle.d_raw, description="Hidden state fed at steps >= 1")
    concat_order: ConcatOrder = Field(ConcatOrder.embed_hidden, description="Order of the embedding and the hidden "
                                      "state in the draft's input projection")
    steps: int | None = Field(None, ge=1, le=64, description="Draft steps per verification (num_speculative_tokens)")
    source: str | None = Field(None, description="Where this consumer's behaviour was read (runtime path, PR)")


class AuxContract(Strict):
    """The hidden-state contract between a trained draft and the server feeding it.

    ``slots`` say which streams the draft reads at step 0 (and their norm state: an MTP or
    EAGLE-1 draft reads stream N *after* the final norm); ``consumer`` says how it pairs them
    with tokens and what it recycles at later steps. Contracts written before ``consumer``
    existed read as EAGLE-3."""

    contract_version: int = CONTRACT_VERSION
    target: ModelInfo
    slots: list[SlotSpec] = Field(min_length=1)
    consumer: ConsumerSpec = Field(default_factory=ConsumerSpec)
    order: Literal["as_listed"] = Field("as_listed", description="Slots are concatenated in list order")
    concat_dim: Literal[-1] = -1
    native: NativeIds | None = Field(None, description="Where the stream ids came from")

    @model_validator(mode="after")
    def _in_range(self) -> AuxContract:
        n = self.target.num_layers
        for i, s in enumerate(self.slots):
            if n is not None and s.stream > n:
                raise ValueError(f"slot {i}: stream {s.stream} out of range 0..{n}")
        return self

    @property
    def stream_ids(self) -> list[int]:
        return [s.stream for s in self.slots]
