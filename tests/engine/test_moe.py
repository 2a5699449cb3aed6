"""MoE building blocks against transformers' own modules: routing rules (ids and weights),
stacked experts (only chosen experts read), the DeepSeek MoE block and its weight conversion
from a folder transformers wrote, and the config reader's refusals."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from pdserve.common.moe_config import MoeConfig
from pdserve.engine.model.deepseek_moe import DeepseekMoE, convert_moe_weights
from pdserve.engine.model.moe import Experts
from pdserve.engine.model.moe_gate import Router, route

HIDDEN = 40
# 12 routed experts in 4 groups of 3, 2 groups kept, 3 experts per token; MLA fields tiny.
DEEPSEEK = {"vocab_size": 64, "hidden_size": HIDDEN, "intermediate_size": 56,
            "num_hidden_layers": 2, "num_attention_heads": 2, "n_routed_experts": 12,
            "num_experts_per_tok": 3, "moe_intermediate_size": 24, "n_group": 4, "topk_group": 2,
            "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": None,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8}
V2_GROUPED = {**DEEPSEEK, "topk_method": "group_limited_greedy", "routed_scaling_factor": 1.5,
              "n_shared_experts": 2}
V3 = {**DEEPSEEK, "routed_scaling_factor": 2.5, "n_shared_experts": 1}


def _hf_config(arch: str, fields: dict):
    cls = {"DeepseekV2ForCausalLM": DeepseekV2Config, "DeepseekV3ForCausalLM": DeepseekV3Config,
           "Qwen3MoeForCausalLM": Qwen3MoeConfig}[arch]
    return cls(**fields)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            t.copy_(torch.randn(t.shape, generator=gen) * 0.5)


def _x(t: int = 96, seed: int = 1) -> torch.Tensor:
    return torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(seed))


ROUTERS = [
    ("DeepseekV2ForCausalLM", {**DEEPSEEK, "topk_method": "greedy",
                               "routed_scaling_factor": 1.5}, DeepseekV2TopkRouter),
    ("DeepseekV2ForCausalLM", V2_GROUPED, DeepseekV2TopkRouter),
    ("DeepseekV3ForCausalLM", V3, DeepseekV3TopkRouter),
    ("DeepseekV3ForCausalLM", {**V3, "norm_topk_prob": False}, DeepseekV3TopkRouter),
    ("Qwen3MoeForCausalLM", {"hidden_size": HIDDEN, "num_experts": 7, "num_experts_per_tok": 3,
                             "norm_topk_prob": True}, Qwen3MoeTopKRouter),
    ("Qwen3MoeForCausalLM", {"hidden_size": HIDDEN, "num_experts": 7, "num_experts_per_tok": 3,
                             "norm_topk_prob": False}, Qwen3MoeTopKRouter),
]


def _router(arch: str, hf_cfg, hf: torch.nn.Module, ops=None, dtype=torch.float32):
    """x -> (weights, ids) as pdserve routes for `arch`, with `hf`'s router weights: DeepSeek's
    `Router`, or Qwen3-MoE's gate linear (`SparseMoeBlock.gate`) and `route`."""
    cfg = MoeConfig.from_hf_dict(hf_cfg.to_dict(), arch)
    if arch != "Qwen3MoeForCausalLM":
        router = Router(HIDDEN, cfg, ops)
        router.load_state_dict(hf.state_dict())
        return router
    gate = torch.nn.Linear(HIDDEN, cfg.num_experts, bias=False, dtype=dtype)
    gate.load_state_dict(hf.state_dict())
    return lambda x: route(gate(x), cfg, ops=ops)


@pytest.mark.parametrize(("arch", "fields", "hf_cls"), ROUTERS,
                         ids=["v2-greedy", "v2-group", "v3-noaux", "v3-unnormed", "qwen3-norm",
                              "qwen3"])
def test_routing_matches_transformers(arch, fields, hf_cls):
    hf_cfg = _hf_config(arch, fields)
    hf = hf_cls(hf_cfg)
    _randomize(hf, seed=3)
    ours = _router(arch, hf_cfg, hf)
    x = _x()
    _, hf_weights, hf_ids = hf(x)
    weights, ids = ours(x)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=1e-6)
    assert len(set(ids.flatten().tolist())) > fields["num_experts_per_tok"]  # not degenerate


def test_noaux_tc_bias_steers_the_choice_but_not_the_weights():
    cfg = MoeConfig.from_hf_dict(V3, "DeepseekV3ForCausalLM")
    router = Router(HIDDEN, cfg)
    _randomize(router, seed=4)
    x = _x(8)
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[7] = 100.0  # expert 7 always chosen
    weights, ids = router(x)
    assert (ids == 7).any(dim=1).all()
    sig = torch.nn.functional.linear(x, router.weight).sigmoid()  # [T, E]
    expected = sig.gather(1, ids)
    expected = expected / expected.sum(dim=1, keepdim=True) * 2.5
    torch.testing.assert_close(weights, expected)


@pytest.mark.parametrize("fields", [V3, {**V3, "norm_topk_prob": False}],
                         ids=["normed", "unnormed"])
def test_the_operators_route_noaux_tc_as_transformers_does(ops, fields):
    """`noaux_tc_route`: transformers' choice and weights (to fp32 rounding), best first."""
    hf_cfg = _hf_config("DeepseekV3ForCausalLM", fields)
    hf = DeepseekV3TopkRouter(hf_cfg)
    _randomize(hf, seed=3)
    ours = Router(HIDDEN, MoeConfig.from_hf_dict(hf_cfg.to_dict(), "DeepseekV3ForCausalLM"), ops)
    ours.load_state_dict(hf.state_dict())
    x = _x(64)
    _, hf_weights, hf_ids = hf(x)
    weights, ids = ours(x)
    order = hf_ids.argsort(dim=1)
    assert torch.equal(ids.sort(dim=1).values, hf_ids.gather(1, order))
    torch.testing.assert_close(weights.gather(1, ids.argsort(dim=1)), hf_weights.gather(1, order),
                               rtol=1e-6, atol=1e-6)
    biased = torch.nn.functional.linear(x, ours.weight).sigmoid() + ours.e_score_correction_bias
    chosen = biased.gather(1, ids)
    assert (chosen[:, :-1] >= chosen[:, 1:]).all()  # best first


QWEN3_ROUTERS = [{"hidden_size": HIDDEN, "num_experts": e, "num_experts_per_tok": k,
                  "norm_topk_prob": norm} for e, k, norm in [(7, 3, True), (7, 3, False),
                                                             (128, 8, True), (5, 5, True)]]


@pytest.mark.parametrize("fields", QWEN3_ROUTERS, ids=["7-3-norm", "7-3", "128-8-norm", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_operators_route_softmax_topk_as_transformers_does(ops, fields, dtype):
    """`softmax_topk_route`: transformers' choice and weights, best first, in the logits'
    dtype (fp32 rounding apart; a bf16 weight may round to its neighbour)."""
    hf_cfg = _hf_config("Qwen3MoeForCausalLM", fields)
    hf = Qwen3MoeTopKRouter(hf_cfg)
    _randomize(hf, seed=3)
    hf.to(dtype)
    ours = _router("Qwen3MoeForCausalLM", hf_cfg, hf, ops, dtype)
    x = _x(64).to(dtype)
    logits, hf_weights, hf_ids = hf(x)
    weights, ids = ours(x)
    assert weights.dtype == dtype and ids.dtype == torch.long
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    chosen = probs.gather(1, ids)  # [T, k]
    assert (chosen[:, :-1] >= chosen[:, 1:]).all()  # best first
    # the same probabilities chosen (bf16 logits tie often: which of equals is PyTorch's pick)
    torch.testing.assert_close(chosen, probs.gather(1, hf_ids).sort(dim=1, descending=True)[0],
                               rtol=0, atol=0)
    left = probs.scatter(1, ids, -1.0).max(dim=1)  # the best expert not chosen
    tied = left.values == chosen[:, -1]
    assert (left.indices[tied] > ids[tied, -1]).all()  # ties to the lower id
    for t in range(x.shape[0]):  # each expert's weight, where both chose it
        mine = dict(zip(ids[t].tolist(), weights[t].float().tolist(), strict=True))
        for e, w in zip(hf_ids[t].tolist(), hf_weights[t].float().tolist(), strict=True):
            if e in mine:
                assert mine[e] == pytest.approx(w, rel=1e-6 if dtype == torch.float32 else 2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_logits_are_the_fp32_gate_products_whatever_the_batch(ops, dtype):
    """`router_logits`: x . w_e in fp32 (to fp32 rounding) for bf16 or fp32 tokens on strided
    rows; each token's logits bit for bit the same alone as among 0-6 others."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(12, 67, generator=gen)  # 67: a vector loop's tail
    x = torch.randn(7, 80, generator=gen).to(dtype)[:, :67]  # rows 80 apart
    logits = ops.router_logits(x, w)
    assert logits.dtype == torch.float32 and logits.shape == (7, 12)
    torch.testing.assert_close(logits.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
    for t in range(7):
        for n in range(1, 7 - t + 1):
            assert torch.equal(ops.router_logits(x[t : t + n], w)[0], logits[t])
    with pytest.raises(RuntimeError, match="the gate weight must be contiguous fp32"):
        ops.router_logits(x, w.bfloat16())
    with pytest.raises(RuntimeError, match="x has 67 columns, the gate weight 66"):
        ops.router_logits(x, w[:, :66].contiguous())


def test_the_operators_break_routing_ties_toward_the_lower_expert(ops):
    logits = torch.zeros(1, 12)  # every score equal: groups 0 and 1, then experts 0, 1, 2
    weights, ids = ops.noaux_tc_route(logits, torch.zeros(12), 3, 4, 2, True, 2.5)
    assert ids.tolist() == [[0, 1, 2]]
    torch.testing.assert_close(weights, torch.full((1, 3), 2.5 / 3))
    with pytest.raises(RuntimeError, match="top_k 7 must fit the 2 best groups of 3"):
        ops.noaux_tc_route(logits, torch.zeros(12), 7, 4, 2, True, 2.5)
    with pytest.raises(RuntimeError, match="n_group must split the 12 experts"):
        ops.noaux_tc_route(logits, torch.zeros(12), 3, 5, 2, True, 2.5)
    with pytest.raises(RuntimeError, match=r"the score bias must be contiguous fp32 \[12\]"):
        ops.noaux_tc_route(logits, torch.zeros(11), 3, 4, 2, True, 2.5)
    weights, ids = ops.softmax_topk_route(logits, 3, False)
    assert ids.tolist() == [[0, 1, 2]]
    torch.testing.assert_close(weights, torch.full((1, 3), 1 / 12))
    with pytest.raises(RuntimeError, match=r"top_k must be 1 to 12 \(the experts\), got 13"):
        ops.softmax_topk_route(logits, 13, True)
    with pytest.raises(RuntimeError, match="logits must be contiguous fp32 or bf16"):
        ops.softmax_topk_route(logits.half(), 3, True)


def test_experts_never_read_unchosen_experts():
    experts = Experts(num_experts=6, hidden_size=HIDDEN, intermediate_size=24)
    _randomize(experts, seed=5)
    ids = torch.tensor([[4, 1], [1, 4], [4, 1]])  # experts 0, 2, 3, 5 unchosen
    weights = torch.rand(3, 2, generator=torch.Generator().manual_seed(6))
    x = _x(3)
    before = experts(x, ids, weights)
    with torch.no_grad():
        for e in (0, 2, 3, 5):
            experts.gate_up_proj[e] = float("nan")
            experts.down_proj[e] = float("nan")
    after = experts(x, ids, weights)
    assert torch.isfinite(after).all()
    assert torch.equal(before, after)


def test_experts_match_a_per_token_reference():
    experts = Experts(num_experts=5, hidden_size=HIDDEN, intermediate_size=24)
    _randomize(experts, seed=7)
    gen = torch.Generator().manual_seed(8)
    x, ids = _x(17), torch.randint(0, 5, (17, 2), generator=gen)
    weights = torch.rand(17, 2, generator=gen)
    expected = torch.zeros_like(x)
    for t in range(17):
        for slot in range(2):
            e = ids[t, slot]
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            expected[t] += weights[t, slot] * (experts.down_proj[e] @ (torch.nn.functional.silu(
                gate) * up))
    torch.testing.assert_close(experts(x, ids, weights), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("arch", "fields"), [("DeepseekV2ForCausalLM", V2_GROUPED),
                                              ("DeepseekV3ForCausalLM", V3)], ids=["v2", "v3"])
def test_deepseek_moe_matches_transformers_from_a_saved_folder(tmp_path, arch, fields):
    """transformers writes one tensor per expert; the conversion stacks them and the block
    then equals transformers' DeepseekV2Moe / DeepseekV3MoE loaded from the same folder."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_hf_config(arch, fields)).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    hf_moe = hf.model.layers[1].mlp
    with torch.no_grad():  # the default init: zero bias, near-uniform scores; make both matter
        if arch == "DeepseekV3ForCausalLM":
            hf_moe.gate.e_score_correction_bias.normal_()
        hf_moe.gate.weight.mul_(20)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in saved
    saved |= {f"model.layers.1.mlp.{k}": v for k, v in hf_moe.state_dict().items()
              if k.startswith("gate.")}
    cfg = MoeConfig.from_hf_dict(hf.config.to_dict(), arch)
    ours = DeepseekMoE(HIDDEN, cfg)
    converted = convert_moe_weights(saved, "model.layers.1.mlp.", cfg)
    ours.load_state_dict({k.removeprefix("model.layers.1.mlp."): v for k, v in converted.items()})
    assert not any(k.startswith("model.layers.1.mlp.") for k in saved)  # all taken
    x = _x(64, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf_moe(x[None])[0], rtol=1e-5, atol=1e-5)


def test_deepseek_moe_converts_stacked_expert_tensors():
    """A checkpoint already in transformers' in-memory layout (stacked experts) loads too."""
    cfg = MoeConfig.from_hf_dict(V3, "DeepseekV3ForCausalLM")
    ref = DeepseekMoE(HIDDEN, cfg)
    _randomize(ref, seed=10)
    shared = ref.shared_experts
    gate, up = shared.gate_up_proj.weight.chunk(2)
    weights = {f"mlp.{k}": v for k, v in ref.state_dict().items() if "shared" not in k}
    weights |= {"mlp.shared_experts.gate_proj.weight": gate,
                "mlp.shared_experts.up_proj.weight": up,
                "mlp.shared_experts.down_proj.weight": shared.down_proj.weight}
    ours = DeepseekMoE(HIDDEN, cfg)
    ours.load_state_dict({k.removeprefix("mlp."): v
                          for k, v in convert_moe_weights(weights, "mlp.", cfg).items()})
    x = _x(16)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))


def test_a_missing_expert_tensor_is_named():
    cfg = MoeConfig.from_hf_dict(V3, "DeepseekV3ForCausalLM")
    with pytest.raises(ValueError, match=r"missing expert tensor.*mlp\.experts\.0\.gate_proj"):
        convert_moe_weights({}, "mlp.", cfg)


@pytest.mark.parametrize("fields", [{"decoder_sparse_step": 2, "mlp_only_layers": [3]},
                                    {"decoder_sparse_step": 1, "mlp_only_layers": [0, 4]}])
def test_qwen3_moe_layers_are_where_transformers_puts_them(fields):
    hf_cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
                            num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=8, num_experts=3, num_experts_per_tok=2,
                            moe_intermediate_size=8, **fields)
    hf = Qwen3MoeForCausalLM(hf_cfg)
    cfg = MoeConfig.from_hf_dict(hf_cfg.to_dict(), "Qwen3MoeForCausalLM")
    hf_moe = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert [cfg.is_moe_layer(i) for i in range(6)] == hf_moe
    assert any(hf_moe) and not all(hf_moe)


def test_deepseek_first_k_dense_layers():
    cfg = MoeConfig.from_hf_dict({**V3, "first_k_dense_replace": 2}, "DeepseekV3ForCausalLM")
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, False, True, True]


def test_dense_architectures_have_no_moe():
    assert MoeConfig.from_hf_dict({"num_experts": 4}, "LlamaForCausalLM") is None


@pytest.mark.parametrize(("arch", "fields", "message"), [
    ("Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 5},
     r"num_experts_per_tok \(5\) must not exceed the number of experts \(4\)"),
    ("DeepseekV3ForCausalLM", {**V3, "topk_group": 5}, r"topk_group \(5\) must not exceed n_group"),
    ("DeepseekV3ForCausalLM", {**V3, "scoring_func": "tanh"}, r"scoring_func 'tanh'"),
    ("DeepseekV2ForCausalLM", {**V2_GROUPED, "scoring_func": "sigmoid"}, r"scoring_func 'sigmoid'"),
    ("DeepseekV2ForCausalLM", {**V2_GROUPED, "topk_method": "noaux_tc"}, r"topk_method 'noaux_tc'"),
    ("DeepseekV3ForCausalLM", {**V3, "n_routed_experts": 10}, r"n_routed_experts \(10\).*n_group"),
    ("DeepseekV2ForCausalLM", {**V2_GROUPED, "n_group": None}, r"n_group and topk_group"),
    ("DeepseekV2ForCausalLM", {**V2_GROUPED, "norm_topk_prob": True}, r"norm_topk_prob"),
    ("DeepseekV3ForCausalLM", {**V3, "moe_layer_freq": 2}, r"moe_layer_freq"),
    ("Qwen3MoeForCausalLM", {"num_experts": 0}, r"num_experts .* must be positive"),
    ("Qwen3MoeForCausalLM", {"num_experts_per_tok": 2.5}, r"num_experts_per_tok must be an int"),
])
def test_bad_moe_config_names_the_field(arch, fields, message):
    with pytest.raises(ValueError, match=message):
        MoeConfig.from_hf_dict(fields, arch)


def test_experts_of_an_empty_batch():
    experts = Experts(num_experts=3, hidden_size=HIDDEN, intermediate_size=8)
    out = experts(torch.empty(0, HIDDEN), torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2))
    assert out.shape == (0, HIDDEN)
