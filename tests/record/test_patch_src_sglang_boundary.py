"""Upstream source quoted verbatim for tests/record/test_patch.py: SGLang boundary style (capture inside the layer boundary): llama.py and deepseek_v2.py 0.5.23.

Apache-2.0, (c) the SGLang / vLLM authors. Provenance and the check that these quotes
are verbatim: tests/record/test_patch_upstream.py. Data only: no tests here.
"""

# name -> (package, version, path in site-packages, qualified name)
WHERE = {
    'SGLANG_0523_LLAMA_FORWARD': ('sglang', '0.5.23', 'sglang/srt/models/llama.py', 'LlamaModel.forward'),
    'SGLANG_0523_DEEPSEEK_FORWARD': ('sglang', '0.5.23', 'sglang/srt/models/deepseek_v2.py', 'DeepseekV2Model.forward'),
    'SGLANG_0523_AUX_LIST': ('sglang', '0.5.23', 'sglang/srt/layers/aux_hidden_states.py', 'AuxHiddenStateList'),
    'SGLANG_0523_AUX_PACKER': ('sglang', '0.5.23', 'sglang/srt/layers/aux_hidden_states.py', 'AuxHiddenStatePacker'),
}

SGLANG_0523_LLAMA_FORWARD = """\
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor = None,
        pp_proxy_tensors: Optional[PPProxyTensors] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, List[torch.Tensor]], PPProxyTensors]:
        if self.pp_group.is_first_rank:
            if input_embeds is None:
                hidden_states = self.embed_tokens(input_ids)
            else:
                hidden_states = input_embeds
            residual_batch.start(forward_batch)
        else:
            assert pp_proxy_tensors is not None
            hidden_states = self.layers[self.start_layer].attn_boundary.from_pp(
                pp_proxy_tensors, forward_batch
            )

        aux_hidden_states = AuxHiddenStateList()
        for i in range(self.start_layer, self.end_layer):
            hidden_states = self.layers[i](
                positions,
                hidden_states,
                forward_batch,
                capture_output=aux_hidden_states.capture
                if i in self.layers_to_capture
                else None,
            )

        if not self.pp_group.is_last_rank:
            return residual_batch.to_pp(hidden_states, forward_batch)
        hidden_states = residual_batch.final_norm(
            hidden_states, forward_batch, self.norm
        )

        if len(aux_hidden_states) == 0:
            return hidden_states

        return hidden_states, aux_hidden_states
"""

SGLANG_0523_DEEPSEEK_FORWARD = """\
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor = None,
        pp_proxy_tensors: Optional[PPProxyTensors] = None,
    ) -> Union[torch.Tensor, PPProxyTensors]:
        total_num_layers = self.end_layer - self.start_layer
        dsa_forward_uses_topk = self._dsa_forward_uses_topk()
        if self.pp_group.is_first_rank:
            if input_embeds is None:
                hidden_states = self.embed_tokens(input_ids)
            else:
                hidden_states = input_embeds
            residual_batch.start(forward_batch)
            initial_topk_indices = None
        else:
            assert pp_proxy_tensors is not None
            hidden_states = self.layers[self.start_layer].attn_boundary.from_pp(
                pp_proxy_tensors, forward_batch
            )
            initial_topk_indices = pp_proxy_tensors.tensors.get("topk_indices")
        index_topk_share = IndexTopKShareState(forward_batch, initial_topk_indices)
        if not self.pp_group.is_first_rank:
            assert not (
                not forward_batch.forward_mode.is_idle()
                and positions.shape[0] != 0
                and self.use_dsa
                and dsa_forward_uses_topk
                and dsa_layer_skips_topk(self.config, self.start_layer)
                and index_topk_share.topk_indices is None
            ), (
                f"PP stage starting at layer {self.start_layer} requires DSA "
                "topk_indices from the previous stage."
            )
        device = positions.device
        zero_allocator = BumpAllocator(
            buffer_size=total_num_layers * 2 * (2 if forward_batch.can_run_tbo else 1),
            dtype=torch.float32,
            device=device,
        )

        has_gemm_output_zero_allocator = hasattr(
            self, "gemm_output_zero_allocator_size"
        )

        gemm_output_zero_allocator = (
            BumpAllocator(
                buffer_size=self.gemm_output_zero_allocator_size,
                dtype=torch.float32,
                device=device,
            )
            if has_gemm_output_zero_allocator
            and self.gemm_output_zero_allocator_size > 0
            else None
        )

        # llama_4_scaling: for supporting Mistral-Large-3 model
        # Compute llama 4 scaling once per forward pass if enabled
        llama_4_scaling: Optional[torch.Tensor] = None
        if self.llama_4_scaling_config is not None:
            llama_4_scaling = _get_llama_4_scaling(
                original_max_position_embeddings=self.llama_4_scaling_config[
                    "original_max_position_embeddings"
                ],
                scaling_beta=self.llama_4_scaling_config["beta"],
                positions=positions,
            )

        normal_start_layer = self.start_layer
        normal_end_layer = self.end_layer
        if forward_batch.can_run_tbo:
            if (
                self.first_k_dense_replace > normal_start_layer
                and self.first_k_dense_replace < normal_end_layer
            ):
                normal_end_layer = self.first_k_dense_replace
            elif self.first_k_dense_replace < normal_start_layer:
                normal_end_layer = normal_start_layer = 0
        # Append-compatible, so the shared capture path below is unchanged.
        aux_hidden_states = AuxHiddenStatePacker(len(self.layers_to_capture))
        for i in range(normal_start_layer, normal_end_layer):
            # NOTE: torch dynamo does not support graph break in context manager
            ctx = (
                nullcontext()
                if check_cuda_graph_backend(Phase.PREFILL, Backend.TC_PIECEWISE)
                else get_global_expert_distribution_recorder().with_current_layer(i)
            )
            with ctx:
                layer = self.layers[i]
                (hidden_states, topk_indices) = layer(
                    positions,
                    hidden_states,
                    forward_batch,
                    zero_allocator,
                    gemm_output_zero_allocator,
                    llama_4_scaling,
                    prev_topk_indices=index_topk_share.topk_indices,
                    captured_last_layer_outputs=aux_hidden_states
                    if i in self.layers_to_capture
                    else None,
                    next_full_attention_layer_id=self.next_full_attention_layer_id.get(
                        i
                    ),
                )
                index_topk_share.update(topk_indices)

        if normal_end_layer != self.end_layer:
            hidden_states = model_forward_stages(
                layers=self.layers[normal_end_layer : self.end_layer],
                enable_tbo=True,
                positions=positions,
                forward_batch=forward_batch,
                hidden_states=hidden_states,
                zero_allocator=zero_allocator,
            )

        if not self.pp_group.is_last_rank:
            proxy_tensors = residual_batch.to_pp(hidden_states, forward_batch)
            if (
                self.use_dsa
                and dsa_forward_uses_topk
                and self.end_layer < self.config.num_hidden_layers
                and dsa_layer_skips_topk(self.config, self.end_layer)
            ):
                topk_indices = index_topk_share.topk_indices
                if (
                    not forward_batch.forward_mode.is_idle()
                    and proxy_tensors["hidden_states"].shape[0] != 0
                ):
                    assert topk_indices is not None, (
                        f"PP stage ending at layer {self.end_layer} must forward "
                        "DSA topk_indices because the next stage starts on a "
                        "skip-topk layer."
                    )
                if topk_indices is None:
                    topk_indices = proxy_tensors["hidden_states"].new_empty(
                        (0, get_dsa_index_topk(self.config)), dtype=torch.int32
                    )
                proxy_tensors.tensors["topk_indices"] = topk_indices
            return proxy_tensors
        else:
            hidden_states = residual_batch.complete_output(hidden_states, forward_batch)
            if not forward_batch.forward_mode.is_idle():
                hidden_states = residual_batch.final_norm(
                    hidden_states, forward_batch, self.norm
                )

        if len(aux_hidden_states) == 0:
            return hidden_states
        return hidden_states, aux_hidden_states.finalize()
"""

SGLANG_0523_AUX_LIST = '''\
class AuxHiddenStateList(list):
    """Retain aux snapshots independently of storage reused by later layers."""

    def capture(self, hidden: torch.Tensor, *, owned: bool = False) -> None:
        """Copy borrowed storage, or adopt a value whose ownership is transferred.

        Views and reusable communication buffers are borrowed even when they
        are different tensor objects from the source.
        """
        self.append(hidden if owned else hidden.clone())
'''

SGLANG_0523_AUX_PACKER = '''\
class AuxHiddenStatePacker:
    """Drop-in for the ``[]`` a model collects Eagle3/DFlash captures into.

    Each ``.append()`` writes into one preallocated ``[tokens, K * hidden]``
    buffer, avoiding the list path's transient ~2x HBM at ``torch.cat``.
    Assumes all captures share leading shape and feature size.

    ``for_batch`` writes into a decode graph runner's buffer when the batch
    carries one, so every graph size aliases it instead of pinning its own.
    """

    def __init__(self, num_captures: int, out: Optional[torch.Tensor] = None) -> None:
        self._num_captures = int(num_captures)
        self._buffer = out
        self._feature_size: Optional[int] = None
        self._idx = 0

    @classmethod
    def for_batch(
        cls, forward_batch: ForwardBatch, num_captures: int
    ) -> AuxHiddenStatePacker:
        return cls(num_captures, out=forward_batch.aux_hidden_states_buffer)

    def slot(self, like: torch.Tensor) -> torch.Tensor:
        """Take the next capture's view of the packed buffer, shaped like ``like``,
        for a producer that writes it in place."""
        feature_size = int(like.shape[-1])
        if self._feature_size is None:
            self._feature_size = feature_size
            shape = (*like.shape[:-1], feature_size * self._num_captures)
            if self._buffer is None:
                self._buffer = like.new_empty(shape)
            elif self._buffer.shape != shape or self._buffer.dtype != like.dtype:
                raise ValueError(
                    f"aux hidden output buffer is {tuple(self._buffer.shape)} "
                    f"{self._buffer.dtype}, captures need {shape} {like.dtype}"
                )
        start = self._idx * self._feature_size
        self._idx += 1
        return self._buffer[..., start : start + self._feature_size]

    def append(self, hidden: torch.Tensor) -> None:
        self.slot(hidden).copy_(hidden)

    def extend(self, hiddens: Iterable[torch.Tensor]) -> None:
        for hidden in hiddens:
            self.append(hidden)

    def capture(self, hidden: torch.Tensor, *, owned: bool = False) -> None:
        """Write directly to the final packed buffer, without an intermediate copy."""
        self.append(hidden)

    def __len__(self) -> int:
        return self._idx

    def finalize(self) -> torch.Tensor:
        """Return the packed buffer; callers guard the empty case on ``len()``."""
        if self._feature_size is None or self._idx != self._num_captures:
            raise RuntimeError(
                f"captured {self._idx} of {self._num_captures} aux hidden states"
            )
        return self._buffer
'''
