"""Where does a bf16 experts kernel differ from the reference? Pairwise rms_norm between reference variants and kernels.

    python tools/diag/diag_bf16_gpu.py [MODEL] [M]                                   # GPU: triton and cuda kernels
    TRITON_INTERPRET=1 python tools/diag/diag_bf16_gpu.py --interpret [MODEL] [M]   # CPU: triton under the interpreter

Variants: the reference with fp32 and float64 accumulation (on the CPU, and on the GPU where there is one), and each
kernel through ``FusedMoEKernel``. Kernels that agree with each other but not with any reference variant share a
difference from the reference's rounding points; a kernel that agrees under the interpreter but not on the GPU
differs through the hardware (its MMA), not its algorithm. Findings: docs/notes/gpu-sessions.md.
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from backends import load_backend  # noqa: E402
from conformance.cases import ExpertsCase  # noqa: E402
from conformance.inputs import make_experts_inputs  # noqa: E402
from conformance.experts_case import moe_config_for  # noqa: E402
from reference.experts import fused_experts  # noqa: E402
from reference.metrics import error_stats  # noqa: E402
from reference.modular import FusedMoEKernel, MoEPrepareAndFinalizeNoEP  # noqa: E402
from specs import load_models  # noqa: E402

args = [a for a in sys.argv[1:] if a != "--interpret"]
interpret = "--interpret" in sys.argv
if interpret and os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("--interpret needs TRITON_INTERPRET=1 in the environment (set before triton is imported)")
model = load_models()[args[0] if args else "mixtral_8x7b"]
case = ExpertsCase(model, "bf16", int(args[1]) if len(args) > 1 else 16, model.cpu_ep_size, 0)
devices = ["cpu"] if interpret or not torch.cuda.is_available() else ["cpu", "cuda"]
kernels = ["triton"] if interpret else ["triton", "cuda"]

outs = {}
for dev in devices:
    inp = make_experts_inputs(case, dev)
    kw = dict(activation=case.activation, global_num_experts=inp.global_num_experts, expert_map=inp.expert_map)
    call = (inp.hidden_states, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids)
    outs[f"ref_{dev}"] = fused_experts(*call, quant_config=inp.quant_config, **kw).cpu()
    outs[f"ref_{dev}_f64"] = fused_experts(*call, quant_config=inp.quant_config, accumulate_dtype=torch.float64,
                                           **kw).cpu()
    if dev == devices[-1] and (interpret or dev == "cuda"):
        for name in kernels:
            t = time.time()
            cls = load_backend(name).experts[0]
            k = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls(moe_config_for(case), inp.quant_config))
            outs[name + ("_interp" if interpret else "")] = k.apply(*call, **kw).cpu()
            print(f"{name}: {time.time() - t:.0f} s", file=sys.stderr)
if "cuda" in devices:
    print("tf32:", torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
names = list(outs)
for i, a in enumerate(names):
    print(a, " ".join(f"{b}:{error_stats(outs[a], outs[b]).rms_norm:.2e}" for b in names[i + 1:]))
