"""Upstream source quoted verbatim for tests/record/test_patch_mtp.py: the MTP draft forwards of vLLM 0.33.0 (deepseek_mtp.py, qwen3_next_mtp.py) and SGLang 0.5.23 (deepseek_nextn.py).

Apache-2.0, (c) the SGLang / vLLM authors. Provenance and the check that these quotes
are verbatim: tests/record/test_patch_upstream.py. Data only: no tests here.
"""

# name -> (package, version, path in site-packages, qualified name)
WHERE = {
    'VLLM_0330_MTP_LAYER_FORWARD': ('vllm', '0.33.0', 'vllm/model_executor/models/deepseek_mtp.py', 'DeepSeekMultiTokenPredictorLayer.forward'),
    'VLLM_0330_MTP_PREDICTOR_FORWARD': ('vllm', '0.33.0', 'vllm/model_executor/models/deepseek_mtp.py', 'DeepSeekMultiTokenPredictor.forward'),
    'VLLM_0330_QWEN3_NEXT_PREDICTOR_FORWARD': ('vllm', '0.33.0', 'vllm/model_executor/models/qwen3_next_mtp.py', 'Qwen3NextMultiTokenPredictor.forward'),
    'VLLM_0330_QWEN3_NEXT_MTP_FORWARD': ('vllm', '0.33.0', 'vllm/model_executor/models/qwen3_next_mtp.py', 'Qwen3NextMTP.forward'),
    'SGLANG_0523_NEXTN_FORWARD': ('sglang', '0.5.23', 'sglang/srt/models/deepseek_nextn.py', 'DeepseekModelNextN.forward'),
}

VLLM_0330_MTP_LAYER_FORWARD = """\
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_index: int = 0,
    ) -> torch.Tensor:
        assert inputs_embeds is not None
        # masking inputs at position 0, as not needed by MTP
        inputs_embeds = torch.where(positions.unsqueeze(-1) == 0, 0, inputs_embeds)
        inputs_embeds = self.enorm(inputs_embeds)
        previous_hidden_states = self.hnorm(previous_hidden_states)

        hidden_states = self.eh_proj(
            torch.cat([inputs_embeds, previous_hidden_states], dim=-1)
        )

        hidden_states, residual = self.mtp_block(
            positions=positions,
            hidden_states=hidden_states,
            residual=None,
        )
        hidden_states = residual + hidden_states  # pre-final-norm (logits hidden)
        if self.mtp_block.use_sequence_parallel_moe:
            hidden_states = tensor_model_parallel_all_gather(hidden_states, 0)
            hidden_states = hidden_states[: positions.shape[0]]
        # Recycle the post-final-norm hidden into the next draft step.
        # compute_logits applies shared_head (== final norm) to the pre-norm
        # element, so logits and the recycle each get exactly one final-norm.
        # Matches SGLang's deepseek_nextn.
        return hidden_states, self.shared_head(hidden_states)
"""

VLLM_0330_MTP_PREDICTOR_FORWARD = """\
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        current_step_idx = spec_step_idx % self.num_mtp_layers
        return self.layers[str(self.mtp_start_layer_idx + current_step_idx)](
            input_ids,
            positions,
            previous_hidden_states,
            inputs_embeds,
            current_step_idx,
        )
"""

VLLM_0330_QWEN3_NEXT_PREDICTOR_FORWARD = """\
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        if get_pp_group().is_first_rank:
            if inputs_embeds is None:
                inputs_embeds = self.embed_input_ids(input_ids)
            assert hidden_states.shape[-1] == inputs_embeds.shape[-1]
            inputs_embeds = self.pre_fc_norm_embedding(inputs_embeds)
            hidden_states = self.pre_fc_norm_hidden(hidden_states)
            hidden_states = torch.cat([inputs_embeds, hidden_states], dim=-1)
            hidden_states = self.fc(hidden_states)
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]

        current_step_idx = spec_step_idx % self.num_mtp_layers
        mtp_layer = self.layers[current_step_idx]
        if mtp_layer.use_attn_reduce_scatter_for_moe:
            assert hidden_states.shape[0] == positions.shape[-1]
            hidden_states = sequence_parallel_chunk(hidden_states)
            assert residual is None
        hidden_states, residual = mtp_layer(
            positions=positions,
            hidden_states=hidden_states,
            residual=residual,
        )

        if not get_pp_group().is_last_rank:
            return IntermediateTensors(
                {"hidden_states": hidden_states, "residual": residual}
            )

        hidden_states, _ = self.norm(hidden_states, residual)
        if mtp_layer.use_attn_reduce_scatter_for_moe:
            hidden_states = tensor_model_parallel_all_gather(hidden_states, 0)
            hidden_states = hidden_states[: positions.shape[-1]]
        return hidden_states
"""

VLLM_0330_QWEN3_NEXT_MTP_FORWARD = """\
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ):
        hidden_states = self.model(
            input_ids, positions, hidden_states, intermediate_tensors, inputs_embeds
        )
        return hidden_states
"""

SGLANG_0523_NEXTN_FORWARD = """\
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor = None,
    ) -> torch.Tensor:
        exit_stack = ExitStack()
        if (
            _is_npu
            and self.quant_config is None
            and get_model().quantization is not None
        ):
            # ascend mtp unquant
            exit_stack.enter_context(envs.SGLANG_DEEPEP_BF16_DISPATCH.override(True))
            exit_stack.enter_context(
                envs.DEEP_NORMAL_MODE_USE_INT8_QUANT.override(False)
            )

        try:
            zero_allocator = BumpAllocator(
                buffer_size=2,
                dtype=torch.float32,
                device=(
                    input_embeds.device
                    if input_embeds is not None
                    else input_ids.device
                ),
            )

            if input_embeds is None:
                input_embeds = self.embed_input_ids(input_ids, forward_batch)
            hidden_states = input_embeds

            if hidden_states.shape[0] > 0:
                previous_hidden_states = forward_batch.spec_info.hidden_states
                if self.rot_weight is not None:
                    previous_hidden_states = torch.matmul(
                        previous_hidden_states, self.rot_weight
                    )
                if _is_cuda:
                    eh_input = fused_eh_norm(
                        hidden_states,
                        previous_hidden_states,
                        self.enorm.weight,
                        self.hnorm.weight,
                        self.enorm.variance_epsilon,
                    )
                else:
                    eh_input = torch.cat(
                        (
                            self.enorm(hidden_states),
                            self.hnorm(previous_hidden_states),
                        ),
                        dim=-1,
                    )
                if isinstance(self.eh_proj, ReplicatedLinear):
                    hidden_states, _ = self.eh_proj(eh_input)
                else:
                    hidden_states = self.eh_proj(eh_input)

            residual_batch.start(forward_batch)
            index_topk_share = IndexTopKShareState.from_mtp_carry(forward_batch)
            with get_global_expert_distribution_recorder().disable_this_region():
                (hidden_states, topk_indices) = self.decoder(
                    positions,
                    hidden_states,
                    forward_batch,
                    zero_allocator,
                    prev_topk_indices=index_topk_share.topk_indices,
                )
            hidden_states = residual_batch.complete_output(hidden_states, forward_batch)
            if not forward_batch.forward_mode.is_idle():
                hidden_states = residual_batch.final_norm(
                    hidden_states, forward_batch, self.shared_head.norm
                )

            index_topk_share.update(topk_indices)
            index_topk_share.publish()
        finally:
            exit_stack.close()

        return hidden_states
"""
