import torch, sys
sys.path.insert(0, '.')
from conformance.cases import ExpertsCase
from conformance.inputs import make_experts_inputs
from conformance.test_experts import moe_config_for
from reference.experts import fused_experts
from reference.metrics import error_stats
from reference.modular import FusedMoEKernel, MoEPrepareAndFinalizeNoEP
from backends import load_backend
from specs import load_models
m = load_models()["mixtral_8x7b"]
case = ExpertsCase(m, "bf16", 16, m.cpu_ep_size, 0)
outs = {}
for dev in ("cpu", "cuda"):
    inp = make_experts_inputs(case, dev)
    kw = dict(activation=case.activation, global_num_experts=inp.global_num_experts, expert_map=inp.expert_map)
    args = (inp.hidden_states, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids)
    outs[f"ref_{dev}"] = fused_experts(*args, quant_config=inp.quant_config, **kw).cpu()
    if dev == "cpu":
        outs["ref_cpu_f64"] = fused_experts(*args, quant_config=inp.quant_config, accumulate_dtype=torch.float64, **kw).cpu()
    else:
        outs["ref_cuda_f64"] = fused_experts(*args, quant_config=inp.quant_config, accumulate_dtype=torch.float64, **kw).cpu()
        for b in ("triton", "cuda"):
            be = load_backend(b)
            cls = be.experts[0]
            k = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls(moe_config_for(case), inp.quant_config))
            outs[b] = k.apply(*args, **kw).cpu()
print("tf32:", torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
names = list(outs)
for i, a in enumerate(names):
    print(a, " ".join(f"{b}:{error_stats(outs[a], outs[b]).rms_norm:.2e}" for b in names[i+1:]))
