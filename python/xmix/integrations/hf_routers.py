"""The MoE routers of each architecture, as the transformers path hooks them: the
``router.logits`` site sits inside a router's forward, so ``xmix.integrations.hf`` replaces
that forward with logits -> site -> the rest of it, reproduced here per router class."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Routers whose forward the transformers path reproduces around the hook (site table name ->
# module class, the router's logits from its input, and the router's forward from its logits
# on). transformers computes a router's logits, scores and top-k in one forward; the site sits
# right after the logits. Each tail below is the rest of that class's forward in transformers
# 5.19, line for line.


def _mixtral_tail(gate, router_logits):
    router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, gate.top_k, dim=-1)
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value, router_indices


def _qwen3_moe_tail(gate, router_logits):
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, gate.top_k, dim=-1)
    if gate.norm_topk_prob:
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_top_value = router_top_value.to(router_logits.dtype)
    return router_logits, router_top_value, router_indices


def _deepseek_v2_tail(gate, router_logits):
    scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    if gate.topk_method == "greedy":
        topk_weights, topk_indices = torch.topk(scores, k=gate.top_k, dim=-1, sorted=False)
    else:  # "group_limited_greedy" (_patch_router refuses any other method at attach)
        group_scores = (
            scores.view(-1, gate.num_group, gate.num_experts // gate.num_group).max(dim=-1).values
        )
        group_idx = torch.topk(group_scores, k=gate.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(-1, gate.num_group, gate.num_experts // gate.num_group)
            .reshape(-1, gate.num_experts)
        )
        scores = scores.masked_fill(~score_mask.bool(), 0.0)
        topk_weights, topk_indices = torch.topk(scores, k=gate.top_k, dim=-1, sorted=False)
    topk_weights = topk_weights * gate.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


def _gpt_oss_tail(gate, router_logits):
    router_top_value, router_indices = torch.topk(router_logits, gate.top_k, dim=-1)
    router_scores = torch.nn.functional.softmax(
        router_top_value, dim=1, dtype=router_top_value.dtype
    )
    return router_logits, router_scores, router_indices


def _linear_logits(gate, hidden_states):
    return F.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)


def _deepseek_v2_logits(gate, hidden_states):
    hidden_states = hidden_states.view(-1, gate.hidden_dim)
    return F.linear(hidden_states.type(torch.float32), gate.weight.type(torch.float32))


def _gpt_oss_logits(gate, hidden_states):
    return F.linear(hidden_states, gate.weight, gate.bias)


ROUTERS = {
    "mixtral": ("MixtralTopKRouter", _linear_logits, _mixtral_tail),
    "qwen3_moe": ("Qwen3MoeTopKRouter", _linear_logits, _qwen3_moe_tail),
    "deepseek_v2": ("DeepseekV2TopkRouter", _deepseek_v2_logits, _deepseek_v2_tail),
    "gpt_oss": ("GptOssTopKRouter", _gpt_oss_logits, _gpt_oss_tail),
}
