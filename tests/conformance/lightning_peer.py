"""Conformance data from Lightning's EMAWeightAveraging callback in a real Lightning fit (the file
format is _common.py's, one record per optimizer step).

Runs in the seed venv (scripts/requirements-seed.txt). Without it, ctest replays the recorded
fixture (tests/conformance/fixtures/).

lightning 2.6.6 (lightning/pytorch/callbacks/weight_averaging.py, read in the installed package):
EMAWeightAveraging is a WeightAveraging whose AveragedModel (made at setup("fit"): a deepcopy of
the LightningModule) gets avg_fn = torch.optim.swa_utils.get_ema_avg_fn(decay), the per-tensor
function decay * ema + (1 - decay) * x (not _foreach_lerp_), copied into each averaged tensor.
on_train_batch_end: step_idx = trainer.global_step - 1; when global_step advanced since the last
update and should_update(step_idx) (step_idx >= update_starting_at_step, if given, and step_idx %
update_every_n_steps == 0) it calls update_parameters: the first one copies (n_averaged == 0),
later ones apply avg_fn; with use_buffers (the callback's default: True) every buffer too,
integer ones included: decay * n + (1 - decay) * m is a float32 tensor, and copy_ into the long
num_batches_tracked truncates it; with use_buffers=False the buffers are copied from the model at
every update. on_train_end copies the average into the model.

Each fit runs a LightningModule with _common.Net's tensors (CPU, SGD), the callback first in
trainer.callbacks and a recorder after it (on_train_batch_end runs in that order). After each
optimizer step (a batch where trainer.global_step advanced; with accumulate_grad_batches = 2,
every second batch) the recorder writes step_KKKK.pt, K = global_step:
  source.<name>   the module's state after the optimizer step (the EMA update does not change it)
  peer.<name>     the callback's _average_model.module state after the callback's on_train_batch_end
  called          1 (the callback is called at every optimizer step; it decides itself)
  counter.n_averaged, counter.global_step, counter.batch_idx, counter.epoch,
  counter.latest_update_step (the callback's _latest_update_step)
and end.pt (end.<name>: the module's state after the fit: the average, copied).
At the last epoch's end the recorder saves a real checkpoint (trainer.save_checkpoint) and writes
checkpoint.pt with its tensors (state_dict.<name>: the average; current_model_state.<name>: the
module's weights; averaging_state.<name>: n_averaged; callback.latest_update_step) and
checkpoint_structure.txt: the checkpoint's keys, the state_dict's, averaging_state's and the
callbacks entry (for the interop with Lightning checkpoints). The every3_from4 scenario keeps the
checkpoints themselves, for emakit's import_state(ema, Peer::lightning, ...) on real Lightning
files: epoch0.ckpt (saved at the first epoch's end, global_step 8, to continue from) and last.ckpt
(global_step 16, the last optimizer step: what an export after the continued steps must match).

The roundtrip scenario (ROUNDTRIP: 3 epochs of 7 optimizer steps, decay 0.9, every second step
from step_idx 3, use_buffers=True) keeps a real checkpoint at every epoch end: epoch0.ckpt
(global_step 7: emakit imports it), epoch1.ckpt (global_step 14: the checkpoint of the run that
_peer_roundtrip.py merges emakit's export into and resumes with Trainer.fit(ckpt_path=...)) and
last.ckpt (global_step 21). Its module is StepSeededLitNet: LitNet's mask flips come from one
generator advanced since construction, whose state no checkpoint holds, so a fit resumed from a
checkpoint would flip other masks than the uninterrupted fit; StepSeededLitNet draws each flip
from a generator seeded with the optimizer step (global_step), so a resumed fit follows the same
trajectory (the data is already the same: an unshuffled loader restarts at the epoch's first
batch, and SGD without momentum has no state). The other scenarios keep LitNet.

The epoch-end scenarios (update_starting_at_epoch, EMAWeightAveraging's other trigger): the
callback's on_train_epoch_end updates the average once more (update_parameters: a copy while
n_averaged is 0) when current_epoch > _latest_update_epoch and should_update(epoch_idx=
current_epoch), i.e. current_epoch >= update_starting_at_epoch; that update is not an optimizer
step: global_step and _latest_update_step do not move, so the step trigger (step_idx % n,
step_idx >= update_starting_at_step) is the same as without it. The recorder, after the callback
in trainer.callbacks (Lightning runs the non-monitoring callbacks' on_train_epoch_end in that
order; the recorder asserts the callback's _latest_update_epoch is this epoch when it updated),
writes at the end of every epoch E (also those before update_starting_at_epoch, where the
average must not move) epoch_EEEE.pt:
  source.<name>   the module's state at the epoch's end (that of its last optimizer step)
  peer.<name>     the callback's average after its on_train_epoch_end
  called          1
  counter.n_averaged, counter.global_step, counter.epoch, counter.latest_update_step,
  counter.latest_update_epoch (the callback's _latest_update_epoch; -1 before any)
and its meta.pt has epoch_records = 1 (the other scenarios write none). The checkpoint of the last
epoch and end.pt come after the last epoch-end update.

The scenarios run under `python lightning_peer.py OUT` (main); importing the module runs none, so
that _peer_roundtrip.py resumes a fit with the same module, data, trainer options and records.
"""
import os
import sys

import _common
import torch

# Not importable outside the seed venv: the ImportError ends the run with exit status 1, a
# failure. ctest runs this only with EMAKIT_SEED_PYTHON.
import lightning.pytorch as pl
from lightning.pytorch.callbacks import EMAWeightAveraging

class LitNet(pl.LightningModule):
    """_common.Net's tensors under the same names; a training step that moves all of them."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        net = _common.Net()
        self.lin, self.conv, self.bn, self.emb = net.lin, net.conv, net.bn, net.emb
        self.register_buffer("mask", net.mask.clone())
        self.flips = torch.Generator().manual_seed(seed + 7)

    def flip_generator(self):
        return self.flips

    def training_step(self, batch, batch_idx):
        x, img, tok = batch
        with torch.no_grad():
            self.mask.copy_((torch.rand(6, generator=self.flip_generator()) > 0.5).float())
        return (self.lin(x) * self.mask).pow(2).mean() + self.bn(self.conv(img)).pow(2).mean() + \
            self.emb(tok).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


class StepSeededLitNet(LitNet):
    """LitNet whose mask flip at each training step comes from a generator seeded with the seed and
    the optimizer steps taken (trainer.global_step): the same flips in a fit resumed from a
    checkpoint as in the uninterrupted fit."""

    def __init__(self, seed):
        super().__init__(seed)
        self.flip_seed = 1000 * (seed + 7)

    def flip_generator(self):
        return torch.Generator().manual_seed(self.flip_seed + self.trainer.global_step)


def dataset(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 2, 5, 5, generator=g),
                                          torch.randint(0, 10, (n,), generator=g))


def state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def step_record(trainer, module, ema, batch_idx):
    """What the recorder writes after optimizer step trainer.global_step (the module's state, the
    callback's average and counters)."""
    avg = ema._average_model
    record = {"source." + k: v for k, v in state(module).items()}
    record.update({"peer." + k: v for k, v in state(avg.module).items()})
    record.update({"called": torch.tensor(1), "counter.n_averaged": avg.n_averaged.detach().clone(),
                   "counter.global_step": torch.tensor(trainer.global_step),
                   "counter.batch_idx": torch.tensor(batch_idx),
                   "counter.epoch": torch.tensor(trainer.current_epoch),
                   "counter.latest_update_step": torch.tensor(ema._latest_update_step)})
    return record


def epoch_record(trainer, module, ema):
    """What the recorder writes at the end of epoch trainer.current_epoch, after the callback's
    on_train_epoch_end (the module's state, the callback's average and counters)."""
    avg = ema._average_model
    record = {"source." + k: v for k, v in state(module).items()}
    record.update({"peer." + k: v for k, v in state(avg.module).items()})
    record.update({"called": torch.tensor(1), "counter.n_averaged": avg.n_averaged.detach().clone(),
                   "counter.global_step": torch.tensor(trainer.global_step),
                   "counter.epoch": torch.tensor(trainer.current_epoch),
                   "counter.latest_update_step": torch.tensor(ema._latest_update_step),
                   "counter.latest_update_epoch": torch.tensor(ema._latest_update_epoch)})
    return record


def text_lines(name, keys):
    return [f"{name}: {', '.join(sorted(keys))}"]


class Recorder(pl.Callback):
    """keep_checkpoint: keep last.ckpt and epoch0.ckpt (every_epoch: epochE.ckpt at each epoch
    end but the last)."""

    def __init__(self, folder, ema_callback, max_epochs, keep_checkpoint, every_epoch=False, record_epochs=False):
        self.folder, self.ema, self.max_epochs = folder, ema_callback, max_epochs
        self.keep_checkpoint, self.every_epoch = keep_checkpoint, every_epoch
        self.record_epochs = record_epochs
        self.last_step = 0
        self.epochs_recorded = 0

    def save(self, name, record):
        torch.save(record, os.path.join(self.folder, name))

    def on_fit_start(self, trainer, module):
        self.save("step_0000.pt", {"source." + k: v for k, v in state(module).items()} | {"called": torch.tensor(0)})

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.last_step:  # no optimizer step in this batch (accumulation)
            return
        assert trainer.global_step == self.last_step + 1
        self.last_step = trainer.global_step
        self.save("step_%04d.pt" % trainer.global_step, step_record(trainer, module, self.ema, batch_idx))

    def on_train_epoch_end(self, trainer, module):
        epoch = trainer.current_epoch
        if self.record_epochs:
            # The callback's on_train_epoch_end ran before this one: when it was due, it updated.
            start = self.ema.update_starting_at_epoch
            due = start is not None and epoch >= start
            assert self.ema._latest_update_epoch == (epoch if due else -1)
            assert epoch == self.epochs_recorded
            self.save("epoch_%04d.pt" % epoch, epoch_record(trainer, module, self.ema))
            self.epochs_recorded += 1
        if self.keep_checkpoint and epoch < self.max_epochs - 1 and (epoch == 0 or self.every_epoch):
            trainer.save_checkpoint(os.path.join(self.folder, "epoch%d.ckpt" % epoch))
        if trainer.current_epoch != self.max_epochs - 1:
            return
        path = os.path.join(self.folder, "last.ckpt")
        trainer.save_checkpoint(path)
        ckpt = torch.load(path, weights_only=False)
        if not self.keep_checkpoint:
            os.remove(path)
        callbacks = ckpt["callbacks"]
        record = {"state_dict." + k: v for k, v in ckpt["state_dict"].items()}
        record.update({"current_model_state." + k: v for k, v in ckpt["current_model_state"].items()})
        record.update({"averaging_state." + k: v for k, v in ckpt["averaging_state"].items()})
        (entry,) = [v for k, v in callbacks.items() if k.startswith("EMAWeightAveraging")]
        record["callback.latest_update_step"] = torch.tensor(entry["latest_update_step"])
        record["global_step"] = torch.tensor(ckpt["global_step"])
        self.save("checkpoint.pt", record)
        lines = text_lines("checkpoint", ckpt.keys())
        lines += text_lines("state_dict", ckpt["state_dict"].keys())
        lines += text_lines("current_model_state", ckpt["current_model_state"].keys())
        lines += text_lines("averaging_state", ckpt["averaging_state"].keys())
        lines += [f"callbacks: {k} -> {sorted(v)}" for k, v in sorted(callbacks.items())]
        with open(os.path.join(self.folder, "checkpoint_structure.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def on_train_end(self, trainer, module):  # after the callback copied the average into the module
        self.save("end.pt", {"end." + k: v for k, v in state(module).items()})


def make_loader(batches_per_epoch, seed):
    return torch.utils.data.DataLoader(dataset(2 * batches_per_epoch, seed + 1), batch_size=2, shuffle=False)


def make_trainer(epochs, accumulate, callbacks):
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, accumulate_grad_batches=accumulate,
                      callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)


def fit(out, scenario, batches_per_epoch, epochs, accumulate=1, seed=0, keep_checkpoint=False, every_epoch=False,
        module_class=LitNet, record_epochs=False, **options):
    folder = os.path.join(out, scenario)
    os.makedirs(folder, exist_ok=True)
    module = module_class(seed)
    buffers = {name for name, _ in module.named_buffers()}
    ema = EMAWeightAveraging(**options)
    recorder = Recorder(folder, ema, epochs, keep_checkpoint, every_epoch, record_epochs)
    trainer = make_trainer(epochs, accumulate, [ema, recorder])
    assert trainer.callbacks.index(ema) < trainer.callbacks.index(recorder)  # the callback's hooks run first
    trainer.fit(module, make_loader(batches_per_epoch, seed))
    assert recorder.last_step == trainer.global_step
    assert recorder.epochs_recorded == (epochs if record_epochs else 0)
    meta = {"steps": torch.tensor(trainer.global_step), "seed": torch.tensor(seed), "epochs": torch.tensor(epochs),
            "accumulate": torch.tensor(accumulate), "batches_per_epoch": torch.tensor(batches_per_epoch)}
    if record_epochs:
        meta["epoch_records"] = torch.tensor(1)
    meta.update({"buffer." + name: torch.tensor(1) for name in buffers})
    torch.save(meta, os.path.join(folder, "meta.pt"))
    print("wrote", folder, trainer.global_step, "optimizer steps")


# The roundtrip scenario (see the docstring); _peer_roundtrip.py resumes it from epoch1.ckpt.
ROUNDTRIP = dict(batches_per_epoch=7, epochs=3, accumulate=1, seed=0, module_class=StepSeededLitNet,
                 options=dict(decay=0.9, update_every_n_steps=2, update_starting_at_step=3, use_buffers=True))


def main(out):
    _common.write_versions(out, ["lightning", "torch"])
    # update_every_n_steps = 3 from step_idx 4 (the first update, at step_idx 6, copies), buffers
    # copied from the model at each update (use_buffers=False).
    fit(out, "every3_from4", batches_per_epoch=8, epochs=2, decay=0.9, update_every_n_steps=3,
        update_starting_at_step=4, use_buffers=False, keep_checkpoint=True)
    # The defaults: decay 0.999, every step from the first (a copy), use_buffers=True (BatchNorm's
    # running stats averaged, num_batches_tracked averaged in float32 and truncated).
    fit(out, "defaults", batches_per_epoch=5, epochs=2)
    # accumulate_grad_batches = 2 (global_step counts optimizer steps: one per two batches), every
    # second step from step_idx 1, use_buffers=True with a decay at which the truncated integer
    # average moves.
    fit(out, "accumulate2_buffers", batches_per_epoch=6, epochs=3, accumulate=2, decay=0.8, update_every_n_steps=2,
        update_starting_at_step=1)
    # Checkpoints at every epoch end, a module whose fit resumes on the same trajectory.
    fit(out, "roundtrip", ROUNDTRIP["batches_per_epoch"], ROUNDTRIP["epochs"], accumulate=ROUNDTRIP["accumulate"],
        seed=ROUNDTRIP["seed"], keep_checkpoint=True, every_epoch=True, module_class=ROUNDTRIP["module_class"],
        **ROUNDTRIP["options"])
    # update_starting_at_epoch = 1 with a step trigger: every third step from step_idx 2 (step_idx
    # 3, 6, .., 18: global_step 4, 7, .., 19), 4 epochs of 5 optimizer steps (5 is not a multiple
    # of 3, so an epoch-end update counted as a step would shift the step trigger), and once more
    # at the end of epochs 1, 2, 3 (global_step 10, 15, 20; at 10 right after the step's own
    # update, with the same weights). n_averaged 9 at the end, global_step 20.
    fit(out, "epoch_ends_every3_from2", batches_per_epoch=5, epochs=4, decay=0.9, update_every_n_steps=3,
        update_starting_at_step=2, update_starting_at_epoch=1, record_epochs=True)
    # The epoch-end update first (a copy, at the end of epoch 0) and buffers copied at every update
    # (use_buffers=False), accumulate_grad_batches = 2 (3 optimizer steps per epoch of 6 batches):
    # epoch ends at global_step 3 (copy), 6, 9; the step trigger (every 4 from step_idx 5) at
    # step_idx 8, global_step 9, the last step, before epoch 2's end. n_averaged 4 at the end.
    fit(out, "epoch_end_first_accumulate2", batches_per_epoch=6, epochs=3, accumulate=2, decay=0.8,
        update_every_n_steps=4, update_starting_at_step=5, update_starting_at_epoch=0, use_buffers=False,
        record_epochs=True)


if __name__ == "__main__":
    main(sys.argv[1])
