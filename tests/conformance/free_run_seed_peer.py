"""Free-running conformance data from the seed packages (Lightning's EMAWeightAveraging in a real
fit, lightly's cosine_schedule + update_momentum, luxonis-train's ModelEma, nvalchemi-toolkit's
EMAHook): each runs _free_run.py's synthetic trajectory on its own, TOTAL steps, and every 10th
step's average (and the last one's) is recorded, so that the committed fixture stays small (the
format is _free_run.py's; lightly's counter.decay: its momentum m at that step, as cosine_schedule
returned it). test_free_running.cpp runs the same trajectory through emakit's presets and compares
the averages bitwise at the recorded steps.

Runs in the seed venv (scripts/requirements-seed.txt). Without it, ctest replays the recorded
fixture (tests/conformance/fixtures/free_run_seed_peer.tar.xz; ./scripts/seed_fixtures.sh
free_run_seed_peer records it again).

Each peer is set to average at every step. The arithmetic each one applies per element, read in
the installed packages:
  lightning 2.6.6 EMAWeightAveraging: an AveragedModel with avg_fn=get_ema_avg_fn(decay), whose
    update_parameters copies decay * ema + (1 - decay) * model into each tensor (the first update
    copies the model); on_train_batch_end updates after each optimizer step.
  lightly 1.6.0 update_momentum(model, model_ema, m): torch._foreach_mul_(model_ema_params, m) then
    torch._foreach_add_(model_ema_params, model_params, alpha=1.0 - m), parameters only.
  luxonis-train 0.6.0 ModelEma.update: decay = self._decay * (1 - math.exp(-self.updates /
    self._decay_tau)), then torch._foreach_lerp_(ema_lerp_values, model_lerp_values,
    weight=1.0 - decay) over the floating state_dict() entries, the others copied.
  nvalchemi-toolkit 0.2.0 EMAHook: an AveragedModel with multi_avg_fn=get_ema_multi_avg_fn(decay)
    (torch._foreach_lerp_(ema, model, 1 - decay)), made at the first eligible step, whose first
    update_parameters copies.

The Lightning fit: a LightningModule with FreeNet's tensors (the synthetic step-0 values written at
construction) and an optimizer (SyntheticSteps) whose step() runs Lightning's closure (the training
step and backward) and then writes the synthetic values of its step into the module, so that the
callback's on_train_batch_end sees exactly the model after step k. The training step's loss uses
the parameters only: no forward through the BatchNorm, whose buffers are the trajectory's.
"""
import copy
import sys
import types
import warnings

import _common
import _free_run
import torch

# Not importable outside the seed venv: the ImportError ends the run with exit status 1, a
# failure. ctest runs this only with EMAKIT_SEED_PYTHON.
import lightning.pytorch as pl
from lightly.models.utils import update_momentum
from lightly.utils.scheduler import cosine_schedule
from lightning.pytorch.callbacks import EMAWeightAveraging
from luxonis_train.callbacks.ema import ModelEma
from nvalchemi.training._stages import TrainingStage
from nvalchemi.training.hooks.ema import EMAHook

out = sys.argv[1]
EVERY = 10

_common.write_versions(out, ["lightning", "lightly", "luxonis-train", "luxonis-ml", "nvalchemi-toolkit", "torch"])
_free_run.write_sources(out)


def state(module):
    return dict(module.state_dict())


# ---- Lightning EMAWeightAveraging --------------------------------------------------------------


class SyntheticSteps(torch.optim.Optimizer):
    """An optimizer whose step k writes the trajectory's step-k values into the module."""

    def __init__(self, module, trajectory):
        super().__init__(module.parameters(), defaults={})
        self.module, self.trajectory, self.k = module, trajectory, 0

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.k += 1
        self.trajectory.write(self.module, self.k)
        return loss


class LitFreeNet(pl.LightningModule):
    def __init__(self):
        super().__init__()
        net = _free_run.FreeNet()
        self.lin, self.bn = net.lin, net.bn
        assert list(self.state_dict()) == list(net.state_dict())  # FreeNet's names, in its order
        self.trajectory = _free_run.Trajectory(self)
        self.trajectory.write(self, 0)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.lin(x).square().mean() + self.bn.weight.square().sum() + self.bn.bias.square().sum()

    def configure_optimizers(self):
        return SyntheticSteps(self, self.trajectory)


class Recorder(pl.Callback):
    """After the EMA callback's on_train_batch_end: records its average at the recorded steps."""

    def __init__(self, ema, recording):
        self.ema, self.recording = ema, recording

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        k = trainer.global_step
        assert module.trajectory is not None and trainer.optimizers[0].k == k
        if self.recording.wants(k):
            averaged = self.ema._average_model
            self.recording.add(k, state(averaged.module), {"n_averaged": int(averaged.n_averaged.item()),
                                                           "global_step": k})


def lightning(scenario, **options):
    recording = _free_run.Recording(out, scenario, every=EVERY, options=options)
    module = LitFreeNet()
    ema = EMAWeightAveraging(**options)
    data = torch.utils.data.TensorDataset(torch.ones(_free_run.TOTAL, 9))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[ema, Recorder(ema, recording)])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=1))
    assert trainer.global_step == _free_run.TOTAL
    recording.save()


with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Lightning's advice (num_workers, ...)
    lightning("lightning_default")                   # decay 0.999, use_buffers=True
    lightning("lightning_9999", decay=0.9999)

# ---- lightly -----------------------------------------------------------------------------------


class LightlyTeacher:
    def __init__(self, student, max_steps, start, end):
        self.student, self.teacher = student, copy.deepcopy(student)
        self.max_steps, self.start, self.end = max_steps, start, end
        self.m = None

    def update(self, k):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # k - 1 > max_steps warns, and returns end
            m = cosine_schedule(k - 1, self.max_steps, self.start, self.end)  # lightly's step = k - 1
        update_momentum(self.student, self.teacher, m)
        self.m = m


def lightly(scenario, start):
    _free_run.run(out, scenario, make=lambda m: LightlyTeacher(m, 1000, start, 1.0),
                  update=lambda t, m, k: t.update(k), average=lambda t: state(t.teacher),
                  counters=lambda t: {"decay": float(t.m)}, every=EVERY,
                  options={"start": start, "end": 1.0, "total_steps": 1000})


lightly("lightly_cosine_0996", 0.996)
lightly("lightly_cosine_099", 0.99)

# ---- luxonis-train ModelEma --------------------------------------------------------------------


def luxonis(scenario, **options):
    _free_run.run(out, scenario, make=lambda m: ModelEma(m, **options), update=lambda e, m, k: e.update(m),
                  average=lambda e: dict(e.state_dict_ema), counters=lambda e: {"updates": e.updates},
                  every=EVERY, options=options)


luxonis("luxonis_default")                              # decay 0.9999, decay_tau 2000
luxonis("luxonis_0999_tau100", decay=0.999, decay_tau=100.0)

# ---- nvalchemi-toolkit EMAHook -----------------------------------------------------------------


class Driver:
    """The hook after each optimizer step, as nvalchemi's TrainingStrategy calls it."""

    def __init__(self, model, hook):
        self.hook = hook
        self.ctx = types.SimpleNamespace(models={"main": model}, step_count=0, workflow=None, loss=None)

    def batch(self):
        self.hook(self.ctx, TrainingStage.AFTER_OPTIMIZER_STEP, will_skip=False)
        self.ctx.step_count += 1


def nvalchemi(scenario, **options):
    _free_run.run(out, scenario, make=lambda m: Driver(m, EMAHook(**options)), update=lambda d, m, k: d.batch(),
                  average=lambda d: state(d.hook.get_averaged_model().module),
                  counters=lambda d: {"num_updates": d.hook.num_updates,
                                      "n_averaged": int(d.hook.get_averaged_model().n_averaged.item())},
                  every=EVERY, options=options)


nvalchemi("nvalchemi_default")                          # decay 0.999, use_buffers=True
nvalchemi("nvalchemi_9999", decay=0.9999)
