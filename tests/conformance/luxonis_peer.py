"""Conformance data from luxonis-train's ModelEma and EMACallback (see _common.py for the format).

Runs in the seed venv (scripts/requirements-seed.txt; luxonis-train pins torch<2.13, which cannot
share the first venv). Without it, ctest replays the recorded fixture (tests/conformance/fixtures/).

ModelEma scenarios use _common.run. The EMACallback scenarios run a real Lightning fit
(lightning.pytorch.Trainer, CPU) of a LightningModule with _common.Net's tensors, with the
callback first in trainer.callbacks and a recorder after it. They write, per training batch
(micro-batch) K = 1.., step_KKKK.pt with
  source.<name>   the module's state at on_train_batch_end (after Lightning's optimizer step, if
                  this batch ended an accumulation window)
  peer.<name>     the callback's average after its on_train_batch_end
  counter.updates, counter.batch_idx, counter.epoch, counter.global_step
and per epoch E = 1..: val_EEEE.pt (valid.<name>: the module's state during validation;
restored.<name>: after validation), ckpt_EEEE.pt (state_dict.<name>: the checkpoint's model
weights; ema_state_dict.<name> and updates: the callback's state in it), and end.pt (the
module's state after the fit).
"""
import os
import sys

import _common
import torch

# Not importable outside the seed venv (luxonis-train pins torch<2.13): the ImportError ends the
# run with exit status 1, a failure. ctest runs this only with EMAKIT_SEED_PYTHON.
import lightning.pytorch as pl
from luxonis_train.callbacks.ema import EMACallback, ModelEma

out = sys.argv[1]

_common.write_versions(out, ["luxonis-train", "luxonis-ml", "lightning", "torch"])


def update(ema, model, step):
    ema.update(model)


ema_state = lambda e: dict(e.state_dict_ema)
_common.run(out, "dynamic_decay", make=lambda m: ModelEma(m, decay=0.99, decay_tau=5.0), update=update,
            peer_state=ema_state, counters=lambda e: {"updates": e.updates}, steps=30)
_common.run(out, "fixed_decay", make=lambda m: ModelEma(m, decay=0.7, use_dynamic_decay=False), update=update,
            peer_state=ema_state, counters=lambda e: {"updates": e.updates}, steps=12)
# A tied weight (head.weight IS emb.weight). ModelEma deep-copies model.state_dict() (the copy keeps
# the two names on one storage) and lerps each entry of it: the tied tensor twice per update, the
# second lerp starting from the first one's result (decay d moves it like d**2).
_common.run(out, "tied_dynamic_decay", make=lambda m: ModelEma(m, decay=0.9, decay_tau=3.0), update=update,
            peer_state=ema_state, counters=lambda e: {"updates": e.updates}, steps=20, model=_common.TiedNet)


# Moving a callback's state to C++ (interop.hpp, Peer::luxonis_callback): an EMACallback whose
# ModelEma is driven step by step; state_0015.pt is torch.save(callback.state_dict()) after step 15,
# as a user saves it (EMACallback.state_dict(): {"ema_state_dict": a dict, "updates": an int}), and
# state_0030.pt the same after the last step: what emakit's export must match, key for key.
def callback_with_ema(model, kept):
    callback = EMACallback(decay=0.99, decay_tau=5.0)
    callback._ema = ModelEma(model, decay=0.99, decay_tau=5.0)  # what its on_fit_start makes
    kept.append(callback)
    return callback


callbacks = []
_common.run(out, "callback_state", make=lambda m: callback_with_ema(m, callbacks),
            update=lambda c, m, step: c.ema.update(m), peer_state=lambda c: dict(c.ema.state_dict_ema),
            counters=lambda c: {"updates": c.ema.updates}, steps=30, saved_state=lambda c: c.state_dict(),
            saved_state_step=15)
torch.save(callbacks[0].state_dict(), os.path.join(out, "callback_state", "state_0030.pt"))


# ---- EMACallback in a Lightning fit ----------------------------------------------------------

class LitNet(pl.LightningModule):
    """_common.Net's tensors under the same names; a training step that moves all of them."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        net = _common.Net()
        self.lin, self.conv, self.bn, self.emb = net.lin, net.conv, net.bn, net.emb
        self.register_buffer("mask", net.mask.clone())
        self.flips = torch.Generator().manual_seed(seed + 7)

    def training_step(self, batch, batch_idx):
        x, img, tok = batch
        with torch.no_grad():
            self.mask.copy_((torch.rand(6, generator=self.flips) > 0.5).float())
        return (self.lin(x) * self.mask).pow(2).mean() + self.bn(self.conv(img)).pow(2).mean() + \
            self.emb(tok).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def dataset(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 2, 5, 5, generator=g),
                                          torch.randint(0, 10, (n,), generator=g))


def state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Recorder(pl.Callback):
    def __init__(self, folder, ema_callback):
        self.folder, self.ema, self.calls, self.epoch = folder, ema_callback, 0, 0

    def save(self, name, record):
        torch.save(record, os.path.join(self.folder, name))

    def on_fit_start(self, trainer, module):  # after EMACallback made the average
        first = {"source." + k: v for k, v in state(module).items()}
        first["called"] = torch.tensor(0)
        self.save("step_0000.pt", first)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.calls += 1
        record = {"source." + k: v for k, v in state(module).items()}
        record.update({"peer." + k: v.detach().clone() for k, v in self.ema.ema.state_dict_ema.items()})
        record.update({"called": torch.tensor(1), "counter.updates": torch.tensor(self.ema.ema.updates),
                       "counter.batch_idx": torch.tensor(batch_idx), "counter.epoch": torch.tensor(trainer.current_epoch),
                       "counter.global_step": torch.tensor(trainer.global_step)})
        self.save("step_%04d.pt" % self.calls, record)

    def on_validation_epoch_start(self, trainer, module):  # after EMACallback swapped the average in
        self.valid = state(module)

    def on_validation_end(self, trainer, module):  # after EMACallback restored the weights
        self.epoch += 1
        record = {"valid." + k: v for k, v in self.valid.items()}
        record.update({"restored." + k: v for k, v in state(module).items()})
        record["calls"] = torch.tensor(self.calls)
        self.save("val_%04d.pt" % self.epoch, record)

    def on_train_epoch_end(self, trainer, module):
        path = os.path.join(self.folder, "checkpoint.ckpt")
        trainer.save_checkpoint(path)
        ckpt = torch.load(path, weights_only=False)
        os.remove(path)
        cb = ckpt["callbacks"][self.ema.state_key]
        record = {"state_dict." + k: v for k, v in ckpt["state_dict"].items()}
        record.update({"ema_state_dict." + k: v for k, v in cb["ema_state_dict"].items()})
        record["updates"] = torch.tensor(cb["updates"])
        record["calls"] = torch.tensor(self.calls)
        self.save("ckpt_%04d.pt" % self.epoch, record)

    def on_train_end(self, trainer, module):  # after EMACallback left the average in the module
        self.save("end.pt", {"end." + k: v for k, v in state(module).items()} | {"calls": torch.tensor(self.calls)})


def fit(scenario, batches_per_epoch, epochs, accumulate, decay, decay_tau, seed=0):
    folder = os.path.join(out, scenario)
    os.makedirs(folder, exist_ok=True)
    module = LitNet(seed)
    buffers = {name for name, _ in module.named_buffers()}
    ema = EMACallback(decay=decay, decay_tau=decay_tau)
    recorder = Recorder(folder, ema)
    loader = torch.utils.data.DataLoader(dataset(2 * batches_per_epoch, seed + 1), batch_size=2, shuffle=False)
    val = torch.utils.data.DataLoader(dataset(2, seed + 2), batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, accumulate_grad_batches=accumulate,
                         callbacks=[ema, recorder], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, loader, val)
    meta = {"steps": torch.tensor(recorder.calls), "seed": torch.tensor(seed), "epochs": torch.tensor(epochs),
            "accumulate": torch.tensor(accumulate), "batches_per_epoch": torch.tensor(batches_per_epoch)}
    meta.update({"buffer." + name: torch.tensor(1) for name in buffers})
    torch.save(meta, os.path.join(folder, "meta.pt"))
    print("wrote", folder, recorder.calls, "batches")


# Epochs of 4 batches, windows of 2: the windows line up with the epochs.
fit("callback_accumulate", batches_per_epoch=4, epochs=3, accumulate=2, decay=0.9, decay_tau=3.0)
# Epochs of 5 batches, windows of 2: Lightning ends the last window of each epoch early (an
# optimizer step after batch 4), and the callback's window (batch_idx % 2 == 0) restarts.
fit("callback_epoch_restart", batches_per_epoch=5, epochs=2, accumulate=2, decay=0.9, decay_tau=3.0)
