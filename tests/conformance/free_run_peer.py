"""Free-running conformance data from the peers of the first venv (ema-pytorch, timm, torch's
AveragedModel, diffusers) and DINO's teacher update (pure torch, written out here): each peer runs
_free_run.py's synthetic trajectory on its own, TOTAL steps, and every step's average is recorded
(the format is _free_run.py's; counter.decay: the decay the peer's last update used, as the peer
computed it). test_free_running.cpp runs the same trajectory through emakit's
presets and compares the averages bitwise after every step.

Each peer is set to average at every step. The arithmetic each one applies per element, read in
the installed packages:
  ema-pytorch 0.8.3 EMA.update_moving_average: tgt.lerp_(src, 1. - current_decay), or with
    use_foreach torch._foreach_lerp_(tgt, src, 1. - current_decay); current_decay is a float32
    tensor's .item().
  timm 1.0.31 ModelEmaV3: torch._foreach_lerp_(ema_values, model_values, weight=1. - decay) over
    the floating state_dict() entries (integers copied); with exclude_buffers over parameters(),
    the buffers copied.
  torch 2.15 AveragedModel: multi_avg_fn=get_ema_multi_avg_fn(decay): torch._foreach_lerp_(ema,
    model, 1 - decay); avg_fn=get_ema_avg_fn(decay): copy_(decay * ema + (1 - decay) * model);
    neither (SWA) on CPU: get_swa_avg_fn, ema + (model - ema) / (n_averaged + 1). The first
    update_parameters copies. use_buffers=False copies the buffers at every update.
  diffusers 0.42.1 EMAModel.step (foreach=False, its default): s_param.sub_(one_minus_decay *
    (s_param - param)), one_minus_decay = 1 - get_decay(optimization_step); with foreach=True
    torch._foreach_sub_(s_params, torch._foreach_sub(s_params, params), alpha=one_minus_decay):
    ATen's sub with alpha, one FMA on a CPU capability with FMA (Arithmetic::fused_subtract).
  DINO (facebookresearch/dino main_dino.py): param_k.data.mul_(m).add_((1 - m) *
    param_q.detach().data) over parameters(), m = momentum_schedule[it] from utils.cosine_scheduler
    (numpy: final + 0.5 (base - final)(1 + cos(pi it / K)), K the array's length).
"""
import copy
import sys

import _free_run
import numpy as np
import torch
from diffusers.training_utils import EMAModel
from ema_pytorch import EMA
from timm.utils.model_ema import ModelEmaV3
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

out = sys.argv[1]
_free_run.write_sources(out)


def state(module):
    return dict(module.state_dict())


# ---- ema-pytorch -------------------------------------------------------------------------------


def ema_pytorch(scenario, **options):
    _free_run.run(out, scenario, make=lambda m: EMA(m, **options), update=lambda e, m, k: e.update(),
                  average=lambda e: state(e.ema_model),
                  counters=lambda e: {"step": int(e.step.item()), "initted": int(e.initted.item()),
                                      "decay": float(e.get_current_decay())},
                  options={k: v for k, v in options.items() if not isinstance(v, bool)})


# Its default beta 0.9999 (the warmup never reaches it in 1011 steps), copies until step 11.
ema_pytorch("ema_pytorch_default", update_after_step=10, update_every=1)
# beta 0.999, reached at step ~300 (inv_gamma 0.01 speeds the warmup up), the foreach path.
ema_pytorch("ema_pytorch_0999", beta=0.999, update_after_step=0, update_every=1, inv_gamma=0.01, use_foreach=True)

# ---- timm ModelEmaV3 ---------------------------------------------------------------------------


def timm(scenario, pass_step, **options):
    def update(ema, model, k):
        step = k if pass_step else None
        ema.update(model, step=step)
        ema.last_decay = float(ema.get_decay(step))  # what update() used

    _free_run.run(out, scenario, make=lambda m: ModelEmaV3(m, **options), update=update,
                  average=lambda e: state(e.module), counters=lambda e: {"decay": e.last_decay},
                  options={k: float(v) for k, v in options.items()} | {"pass_step": float(pass_step)})


timm("timm_warmup", pass_step=True, use_warmup=True)                  # 0.9999, warmup by step
timm("timm_step", pass_step=True)                                     # 0.9999 from step 2 (step 1: d = 0)
timm("timm_0999_exclude_buffers", pass_step=True, decay=0.999, exclude_buffers=True)
timm("timm_no_step", pass_step=False)                                 # update(model): 0.9999 from the first

# ---- torch AveragedModel -----------------------------------------------------------------------


def averaged_model(scenario, decay, use_buffers, multi):
    fn = {"multi_avg_fn": get_ema_multi_avg_fn(decay)} if multi else {"avg_fn": get_ema_avg_fn(decay)}
    _free_run.run(out, scenario, make=lambda m: AveragedModel(m, use_buffers=use_buffers, **fn),
                  update=lambda a, m, k: a.update_parameters(m), average=lambda a: state(a.module),
                  counters=lambda a: {"n_averaged": int(a.n_averaged.item())},
                  options={"decay": decay, "use_buffers": float(use_buffers), "multi": float(multi)})


averaged_model("averaged_model_ema", 0.999, use_buffers=False, multi=True)             # get_ema_multi_avg_fn()
averaged_model("averaged_model_ema_9999_buffers", 0.9999, use_buffers=True, multi=True)
averaged_model("averaged_model_avg_fn", 0.999, use_buffers=False, multi=False)         # get_ema_avg_fn()
averaged_model("averaged_model_avg_fn_9999_buffers", 0.9999, use_buffers=True, multi=False)

# AveragedModel(model): SWA, the running mean. On CPU (no foreach kernels there) each update is
# get_swa_avg_fn's a + (x - a) / (n_averaged + 1), a division; on CUDA _foreach_lerp_ with
# 1 / (n + 1), which emakit's preset computes (fused_lerp with w = 1/n exactly).
_free_run.run(out, "averaged_model_swa", make=lambda m: AveragedModel(m),
              update=lambda a, m, k: a.update_parameters(m), average=lambda a: state(a.module),
              counters=lambda a: {"n_averaged": int(a.n_averaged.item())}, options={"use_buffers": 0.0})

# ---- diffusers EMAModel ------------------------------------------------------------------------


def diffusers(scenario, **options):
    def average(ema):
        return {name: s for (name, _), s in zip(ema.model.named_parameters(), ema.shadow_params)}

    def make(model):
        ema = EMAModel(model.parameters(), **options)
        ema.model = model  # for the names of its shadow_params (the order of model.parameters())
        return ema

    _free_run.run(out, scenario, make=make, update=lambda e, m, k: e.step(m.parameters()), average=average,
                  counters=lambda e: {"optimization_step": int(e.optimization_step),
                                      "decay": float(e.cur_decay_value)},
                  options={k: float(v) for k, v in options.items()})


diffusers("diffusers_ramp")                                  # the TF ramp, capped at 0.9999
diffusers("diffusers_warmup", use_ema_warmup=True)           # inv_gamma 1, power 2/3
diffusers("diffusers_fixed_9999", min_decay=0.9999)          # 0.9999 from step 2 (step 1: d = 0)
diffusers("diffusers_foreach", foreach=True)                 # the TF ramp, its foreach path

# ---- DINO's teacher ----------------------------------------------------------------------------


def dino_cosine_scheduler(base_value, final_value, epochs, niter_per_ep):
    """DINO's utils.cosine_scheduler without warmup, written out: K = epochs * niter_per_ep values."""
    iters = np.arange(epochs * niter_per_ep)
    schedule = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))
    assert len(schedule) == epochs * niter_per_ep
    return schedule


class DinoTeacher:
    def __init__(self, student, schedule):
        self.student, self.schedule = student, schedule
        self.teacher = copy.deepcopy(student)
        self.m = None

    @torch.no_grad()
    def update(self, k):
        m = self.schedule[k - 1]  # DINO's it = 0 at the first optimizer step
        self.m = float(m)
        for param_q, param_k in zip(self.student.parameters(), self.teacher.parameters()):
            param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)


def dino(scenario, base):
    schedule = dino_cosine_scheduler(base, 1.0, epochs=10, niter_per_ep=100)  # K = 1000 iterations
    _free_run.run(out, scenario, make=lambda m: DinoTeacher(m, schedule), update=lambda t, m, k: t.update(k),
                  average=lambda t: state(t.teacher), counters=lambda t: {"decay": t.m}, total=len(schedule),
                  options={"start": base, "end": 1.0, "total_steps": len(schedule)})


dino("dino_cosine_0996", 0.996)
dino("dino_cosine_099", 0.99)
