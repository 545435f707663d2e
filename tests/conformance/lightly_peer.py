"""Conformance data from lightly's momentum teacher: cosine_schedule + update_momentum (the file
format is _common.py's; the trajectory is a real training loop, not _common.run's noise).

Runs in the seed venv (scripts/requirements-seed.txt). Without it, ctest replays the recorded
fixture (tests/conformance/fixtures/).

lightly 1.6.0 (read in the installed package):
  - lightly.utils.scheduler.cosine_schedule(step, max_steps, start, end): end for max_steps <= 1
    or step >= max_steps - 1, else end - (end - start) * (np.cos(np.pi * step / (max_steps - 1))
    + 1) / 2, as a Python float (float64). step > max_steps is allowed: it warns (RuntimeWarning)
    and returns end. Negative step or max_steps raise.
  - lightly.models.utils.update_momentum(model, model_ema, m): over the parameters only
    (buffers untouched), torch._foreach_mul_(ema, m) then torch._foreach_add_(ema, model,
    alpha=1 - m).

The scenario is BYOL's: a student (_common.Net's tensors), a predictor trained with it by SGD with
momentum, a teacher = deepcopy(student); per optimizer step k = 0, 1, ..: the optimizer steps the
student, then m = schedule(k), then the teacher update. The teacher's forward runs in eval mode
under no_grad, so only the momentum update moves it (its buffers stay those of the deepcopy).

Each step record (step K = k + 1) holds
  source.<name>   the student's state after the optimizer step, before the teacher update
  peer.<name>     the teacher's state after the update (parameters and buffers)
  counter.m       the momentum m of this step (float64, as the schedule returned it)
  counter.k       the schedule's step k (K - 1)
  counter.warned  1 when cosine_schedule warned at this step (k > max_steps)
and meta.pt the scenario's steps, max_steps (K), start, end.

The per-epoch scenarios are lightly's BYOL example loop (examples/pytorch/byol.py in lightly's
repository, not in the installed package): per epoch, momentum_val = cosine_schedule(epoch,
max_epochs, 0.996, 1), computed once; per batch, update_momentum(student, teacher,
m=momentum_val). The example calls update_momentum at the start of each batch, before the forward
pass and the optimizer step (byol_epoch_momentum); a loop that updates after the optimizer step
(byol_epoch_momentum_after_step) is recorded too. Either way the teacher updates once per batch
with the momentum of that batch's epoch, and the last batch's update (update first) or the first
batch's (update last) sees the student across an epoch boundary. The pair is the scenarios' above
(the teacher in eval mode: the example leaves its momentum networks in train mode, whose forward
passes would move the teacher's BatchNorm statistics, buffers that update_momentum never touches
and the cosine teacher does not hold). Their records are one per update (step K = the K-th
update, k = K - 1 the batch index over the run), with
  source.<name>   the student's state the update read (update first: after K - 1 optimizer steps;
                  update last: after K)
  peer.<name>     the teacher's state after the update
  counter.m       momentum_val of the batch's epoch (float64, as the schedule returned it)
  counter.epoch   that epoch (the schedule's step), counter.batch the batch in it, counter.k
  counter.warned  1 when cosine_schedule warned (never: epoch < max_epochs)
and meta.pt steps, max_steps (max_epochs, the schedule's max_steps), steps_per_epoch (batches per
epoch), update_first (1: the example's order), start, end.
"""
import copy
import os
import sys
import warnings

import _common
import numpy as np
import torch

# Not importable outside the seed venv: the ImportError ends the run with exit status 1, a
# failure. ctest runs this only with EMAKIT_SEED_PYTHON.
from lightly.models.utils import update_momentum
from lightly.utils.scheduler import cosine_schedule

out = sys.argv[1]

_common.write_versions(out, ["lightly", "torch"])


def dino_cosine_scheduler(base_value, final_value, epochs, niter_per_ep):
    """DINO's utils.cosine_scheduler (facebookresearch/dino, no warmup), written out here: the
    schedule is an array over iters = 0 .. epochs * niter_per_ep - 1, and the cosine's period is
    its length K (not K - 1 as lightly's): final + 0.5 * (base - final) * (1 + cos(pi * k / K))."""
    iters = np.arange(epochs * niter_per_ep)
    schedule = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))
    assert len(schedule) == epochs * niter_per_ep
    return schedule


def dino_momentum_update(student, teacher, m):
    """DINO's teacher update (main_dino.py): param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)."""
    with torch.no_grad():
        for param_q, param_k in zip(student.parameters(), teacher.parameters()):
            param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)


def features(net, batch):
    x, img, tok = batch
    return torch.cat([(net.lin(x) * net.mask).flatten(1), net.bn(net.conv(img)).flatten(1), net.emb(tok)], dim=1)


def views(generator, n=4):
    return (torch.randn(n, 8, generator=generator), torch.randn(n, 2, 5, 5, generator=generator),
            torch.randint(0, 10, (n,), generator=generator))


def byol_pair(seed):
    """The student (_common.Net), its predictor, the teacher (a deepcopy, in eval mode), the
    optimizer and the views' generator, seeded."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    student = _common.Net()
    predictor = torch.nn.Linear(37, 37)
    teacher = copy.deepcopy(student)
    teacher.eval()
    optimizer = torch.optim.SGD(list(student.parameters()) + list(predictor.parameters()), lr=0.05, momentum=0.9)
    return student, predictor, teacher, optimizer, generator


def train_step(student, predictor, teacher, optimizer, generator):
    """One BYOL step: the teacher's target (no_grad), the student's prediction, the optimizer step."""
    student.train()
    view_a, view_b = views(generator), views(generator)
    with torch.no_grad():
        target = features(teacher, view_b)
    loss = (predictor(features(student, view_a)) - target).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def save_first(folder, student):
    torch.save({"called": torch.tensor(0)} | {"source." + k: v for k, v in _common.state(student).items()},
               os.path.join(folder, "step_0000.pt"))


def run(scenario, steps, max_steps, start, end, momentum, update, seed=0):
    """momentum(k) -> (m, warned); update(student, teacher, m) as the package does."""
    folder = os.path.join(out, scenario)
    os.makedirs(folder, exist_ok=True)
    student, predictor, teacher, optimizer, generator = byol_pair(seed)
    save_first(folder, student)
    for k in range(steps):
        train_step(student, predictor, teacher, optimizer, generator)
        record = {"source." + n: v for n, v in _common.state(student).items()}
        m, warned = momentum(k)
        update(student, teacher, m)
        record.update({"peer." + n: v for n, v in _common.state(teacher).items()})
        record.update({"called": torch.tensor(1), "counter.m": torch.tensor(m, dtype=torch.float64),
                       "counter.k": torch.tensor(k), "counter.warned": torch.tensor(int(warned))})
        torch.save(record, os.path.join(folder, "step_%04d.pt" % (k + 1)))
    meta = {"steps": torch.tensor(steps), "seed": torch.tensor(seed), "max_steps": torch.tensor(max_steps),
            "start": torch.tensor(start, dtype=torch.float64), "end": torch.tensor(end, dtype=torch.float64)}
    meta.update({"buffer." + name: torch.tensor(1) for name, _ in student.named_buffers()})
    torch.save(meta, os.path.join(folder, "meta.pt"))
    print("wrote", folder, steps, "steps")


def run_per_epoch(scenario, max_epochs, batches_per_epoch, start, end, update_first, seed=0):
    """lightly's BYOL example loop: the momentum once per epoch, update_momentum once per batch,
    before the batch's optimizer step (update_first, the example's order) or after it."""
    folder = os.path.join(out, scenario)
    os.makedirs(folder, exist_ok=True)
    student, predictor, teacher, optimizer, generator = byol_pair(seed)
    save_first(folder, student)
    momentum = lightly_momentum(max_epochs, start, end)
    k = 0
    for epoch in range(max_epochs):
        momentum_val, warned = momentum(epoch)
        for batch in range(batches_per_epoch):
            if not update_first:
                train_step(student, predictor, teacher, optimizer, generator)
            record = {"source." + n: v for n, v in _common.state(student).items()}
            update_momentum(student, teacher, m=momentum_val)
            record.update({"peer." + n: v for n, v in _common.state(teacher).items()})
            if update_first:
                train_step(student, predictor, teacher, optimizer, generator)
            record.update({"called": torch.tensor(1), "counter.m": torch.tensor(momentum_val, dtype=torch.float64),
                           "counter.epoch": torch.tensor(epoch), "counter.batch": torch.tensor(batch),
                           "counter.k": torch.tensor(k), "counter.warned": torch.tensor(int(warned))})
            k += 1
            torch.save(record, os.path.join(folder, "step_%04d.pt" % k))
    meta = {"steps": torch.tensor(k), "seed": torch.tensor(seed), "max_steps": torch.tensor(max_epochs),
            "steps_per_epoch": torch.tensor(batches_per_epoch), "update_first": torch.tensor(int(update_first)),
            "start": torch.tensor(start, dtype=torch.float64), "end": torch.tensor(end, dtype=torch.float64)}
    meta.update({"buffer." + name: torch.tensor(1) for name, _ in student.named_buffers()})
    torch.save(meta, os.path.join(folder, "meta.pt"))
    print("wrote", folder, k, "updates")


def lightly_momentum(max_steps, start, end):
    def momentum(k):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = cosine_schedule(k, max_steps, start, end)
        assert isinstance(m, float)
        return m, any(issubclass(w.category, RuntimeWarning) for w in caught)
    return momentum


# lightly's defaults for BYOL (0.996 -> 1), K = 30, run past K: k = 29 .. 33 give end (m = 1, the
# teacher stops), k = 31 .. 33 warn.
run("byol_cosine", steps=34, max_steps=30, start=0.996, end=1.0, momentum=lightly_momentum(30, 0.996, 1.0),
    update=update_momentum)
# Other ends (a faster teacher): 0.9 -> 0.99, K = 20, two steps past K - 1.
run("cosine_other_ends", steps=22, max_steps=20, start=0.9, end=0.99, momentum=lightly_momentum(20, 0.9, 0.99),
    update=update_momentum)
# DINO: K' = K (the schedule array has K entries, one per iteration; there is no k >= K).
dino = dino_cosine_scheduler(0.996, 1.0, epochs=3, niter_per_ep=10)
run("dino_cosine", steps=30, max_steps=30, start=0.996, end=1.0, momentum=lambda k: (float(dino[k]), False),
    update=dino_momentum_update)
# lightly's BYOL example: 6 epochs of 4 batches, cosine_schedule(epoch, 6, 0.996, 1) per epoch
# (epoch 5 = max_epochs - 1 gives `end`: the teacher stops), update_momentum at each batch's start.
run_per_epoch("byol_epoch_momentum", max_epochs=6, batches_per_epoch=4, start=0.996, end=1.0, update_first=True)
# The same with the update after each optimizer step, and an epoch length (3) that is neither the
# first scenario's nor a divisor of it, other ends.
run_per_epoch("byol_epoch_momentum_after_step", max_epochs=5, batches_per_epoch=3, start=0.9, end=0.99,
              update_first=False)
