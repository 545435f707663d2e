"""The Python side of emakit's interop round trips with the real Python peers (not a generator:
a test runs it).

  <python> _peer_roundtrip.py PEER SCENARIO_DIR EXPORT FROM_STEP OUT_FILE

<python>: the venv that holds PEER's package: the seed venv (scripts/requirements-seed.txt) for
luxonis_callback, lightning and nvalchemi_hook; the first venv (scripts/requirements.txt) for
ema_pytorch, timm_v3 and averaged_model. The script imports a peer's package only when it runs
that peer, so that it runs in either venv.

A round trip: the Python peer saves its state after step N, emakit imports it and replays steps
N+1 .. F in C++, exports the peer's state after step F (EXPORT, written by export_state), and this
script loads EXPORT into the real Python peer as a user of that package would and continues it
over steps F+1 .. L of the same recorded trajectory, L being the scenario's last step. The test
compares OUT_FILE with the generator's record of step L (the run that never left Python).

  PEER          luxonis_callback | lightning | nvalchemi_hook | ema_pytorch | timm_v3 | averaged_model
  SCENARIO_DIR  the scenario folder the generator wrote (step_KKKK.pt and meta.pt: _common.py's
                format); its name selects the peer's config:
                  luxonis_callback  luxonis_peer.py's callback_state: N = 15 (state_0015.pt),
                                    F any step 1 .. 30, L = 30
                  nvalchemi_hook    nvalchemi_peer.py's resume: N = 8 (state_0008.pt), F any
                                    batch 1 .. 20 (the step_KKKK.pt number, a batch: vetoed
                                    batches complete no optimizer step), L = 20
                  lightning         lightning_peer.py's roundtrip: N = 7 (epoch0.ckpt), F = 14
                                    (epoch1.ckpt: F must be the global_step of an epochE.ckpt in
                                    the folder), L = 21
                  ema_pytorch       ema_pytorch_peer.py's defaults_with_skips (EMA(model,
                                    include_online_model=False), ema-pytorch's defaults; steps 7,
                                    8, 55, 101 not called): N = 120 (state_0120.pt), F any step
                                    1 .. 160, L = 160
                  averaged_model    averaged_model_peer.py's ema_no_buffers (AveragedModel(model,
                                    multi_avg_fn=get_ema_multi_avg_fn(0.95), use_buffers=False);
                                    steps 4, 5 not called): N = 12 (state_0012.pt), F any step
                                    1 .. 30, L = 30
                  timm_v3           timm_peer.py's warmup_with_step (ModelEmaV3(model, decay=0.99,
                                    min_decay=0.1, update_after_step=2, use_warmup=True,
                                    warmup_power=3/4), update(model, step=K)): N = 25
                                    (state_0025.pt), F any step 1 .. 40, L = 40
  EXPORT        emakit's export, read with torch.load(EXPORT, weights_only=True); a plain dict:
                  luxonis_callback  {"ema_state_dict": {<state_dict name>: tensor}, "updates": int}
                                    (what EMACallback.state_dict() returns)
                  nvalchemi_hook    {"decay": float, "update_every": int, "start_step": int,
                                    "use_buffers": bool, "num_updates": int,
                                    "averaged_model_state": {"module.<name>": tensor,
                                    "n_averaged": long tensor}} (EMAHook.state_dict() without
                                    model_key)
                  lightning         {"state_dict": {<name>: tensor}, "averaging_state":
                                    {"n_averaged": long tensor}, "callbacks":
                                    {"EMAWeightAveraging": {"latest_update_step": int}},
                                    "global_step": int}
                  ema_pytorch       {"ema_model.<name>": tensor for each floating entry of the
                                    model's state_dict() (emakit leaves out the integer buffers,
                                    bn.num_batches_tracked, which ema-pytorch never updates),
                                    "step": long tensor, "initted": bool tensor} (0-d counters)
                  averaged_model    {"module.<name>": tensor for each entry of the model's
                                    state_dict(), "n_averaged": long tensor}
                  timm_v3           {"module.<name>": tensor for each entry of the model's
                                    state_dict()} (no counter: timm's caller passes the step)
                Exactly these keys and Python types; every tensor of the model's dtype and shape
                (a load would convert another dtype silently). For the first venv's peers the
                export's counters must also be the recorded run's after step F (counter.step and
                counter.initted, counter.n_averaged of step_F.pt).
  FROM_STEP     F: the step after which EXPORT holds the peer's state.
  OUT_FILE      written with torch.save, a plain dict: peer.<name> = the peer's averaged tensors
                after step L (the generator's peer.<name>), counter.<c> = its counters after step L
                (the generator's counter.<c>), loaded_from_export = tensor(1): the peer's state
                right after the load was checked to equal EXPORT's tensors and counters bitwise.
                timm_v3's counter.none = tensor(0) is timm_peer.py's placeholder (ModelEmaV3 holds no
                counter), written because the generator records it.

How each peer loads EXPORT (the package's own restore path, into a fresh peer made with the
scenario's config, on a model holding the recorded source.* of step F; ema_pytorch: see there):
  luxonis_callback  EMACallback(**config).load_state_dict(EXPORT) (what Lightning calls when it
                    restores a checkpoint), then its on_fit_start(trainer, model), which builds the
                    ModelEma from the model and puts the loaded average and update count in it.
                    Each step K: the model is set to step K's source.*, then callback.ema.update
                    (as luxonis_peer.py drives it).
  nvalchemi_hook    EMAHook(**config).load_state_dict(EXPORT), ctx.step_count set to step F's
                    counter.step_count (the strategy's checkpoint restores it; EMAHook's state does
                    not hold it), then hook(ctx, SETUP), as TrainingStrategy.run starts: the hook
                    builds its AveragedModel and applies the loaded state. Each batch K: the model
                    is set to step K's source.*, then nvalchemi_peer.Driver.batch(vetoed) with
                    step K's vetoed, as nvalchemi_peer.py drives it.
  lightning         the run's own checkpoint at F (epochE.ckpt, read with torch.load),
                    whose current_model_state must be step F's source.*, gets EXPORT's four
                    entries merged in (state_dict, averaging_state, callbacks["EMAWeightAveraging"],
                    global_step; the other callbacks' entries, loops, optimizer_states kept) and
                    is saved to a temporary file; a CPU Trainer.fit(ckpt_path=that file) with
                    lightning_peer.py's module, data, trainer options and a fresh
                    EMAWeightAveraging of ROUNDTRIP's options resumes the fit to L, the model
                    trained by Lightning itself. Each optimizer step's module state must equal the
                    recorded source.* bitwise (the scenario's module makes a resumed fit follow the
                    same trajectory: lightning_peer.py), else the script fails naming the step.
  ema_pytorch       EMA(model, **config) made while the model holds step 0's source.* (the
                    state the recorded run made its EMA from: ema-pytorch never updates its integer
                    buffers, so bn.num_batches_tracked keeps the value of the model it copied),
                    then ema.load_state_dict(EXPORT, strict=False) (the EMA also holds entries the
                    export leaves out: the load must report exactly the integer buffers
                    ema_model.<name> missing and nothing unexpected), then the model set to step
                    F's source.*. Each step K: the model is set to step K's source.*, then
                    ema.update() if step K's called is 1 (as ema_pytorch_peer.py drives it).
  averaged_model    AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=...)
                    .load_state_dict(EXPORT, strict=True). Each step K: the model is set to step
                    K's source.*, then update_parameters(model) if step K's called is 1.
  timm_v3           ModelEmaV3(model, **config).load_state_dict(EXPORT, strict=True). Each step K:
                    the model is set to step K's source.*, then update(model, step=K) if step K's
                    called is 1 (timm_peer.py's with_step).

Exit 0 when everything above held and OUT_FILE is written; otherwise 1 with a message naming the
bad value (a missing or extra key, a wrong type, dtype or shape, a load the package refused, a
state after the load that differs from EXPORT, a counter that differs from the recorded run's at
F, a resumed fit off the recorded trajectory). The self-check, which needs no C++:
_peer_roundtrip_check.py."""
import glob
import os
import sys
import tempfile

import torch

import _common

PEERS = ("luxonis_callback", "lightning", "nvalchemi_hook", "ema_pytorch", "timm_v3", "averaged_model")
# luxonis_peer.py's callback_state (that generator runs its scenarios at import: the config is
# repeated here, and a drift shows as a difference at step L).
LUXONIS_SCENARIOS = {"callback_state": dict(decay=0.99, decay_tau=5.0)}
# The first venv's scenarios, repeated for the same reason from ema_pytorch_peer.py,
# averaged_model_peer.py (decay: get_ema_multi_avg_fn's) and timm_peer.py.
EMA_PYTORCH_SCENARIOS = {"defaults_with_skips": dict(include_online_model=False)}
AVERAGED_MODEL_SCENARIOS = {"ema_no_buffers": dict(decay=0.95, use_buffers=False)}
TIMM_V3_SCENARIOS = {"warmup_with_step": dict(decay=0.99, min_decay=0.1, update_after_step=2, use_warmup=True,
                                              warmup_power=3 / 4)}


class Failure(Exception):
    pass


def fail(message):
    raise Failure(message)


def raw(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a, b):
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
        a.shape == b.shape and torch.equal(raw(a), raw(b))


def load(path, what):
    if not os.path.isfile(path):
        fail(f"{what}: no file {path}")
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - reported with the file's name
        fail(f"{what}: torch.load({path}, weights_only=True) failed: {type(e).__name__}: {e}")


def step_record(folder, step):
    return load(os.path.join(folder, "step_%04d.pt" % step), f"step {step} of {folder}")


def prefixed(record, prefix):
    return {k[len(prefix):]: v for k, v in record.items() if k.startswith(prefix)}


def set_model(model, record, step):
    source = prefixed(record, "source.")
    try:
        model.load_state_dict(source)
    except RuntimeError as e:
        fail(f"step {step}'s source.* does not load into the model: {e}")


def article(kind):
    return ("an " if kind.__name__[0] in "aeiou" else "a ") + kind.__name__


def check_type(value, kind, where):
    if type(value) is not kind:
        fail(f"{where} is {article(type(value))} ({value!r:.80}), the peer's state holds {article(kind)}")


def check_keys(d, expected, where):
    missing, extra = sorted(set(expected) - set(d)), sorted(set(d) - set(expected))
    if missing or extra:
        fail(f"{where}: missing keys {missing}, extra keys {extra} (expected {sorted(expected)})")


def check_tensors(d, expected, where):
    """d: name -> tensor with exactly expected's names, dtypes and shapes."""
    check_type(d, dict, where)
    check_keys(d, expected, where)
    for name, ref in expected.items():
        t = d[name]
        if not isinstance(t, torch.Tensor):
            fail(f"{where}[{name!r}] is {article(type(t))}, not a tensor")
        if t.dtype != ref.dtype or t.shape != ref.shape:
            fail(f"{where}[{name!r}] is {t.dtype} {list(t.shape)}, the peer's is {ref.dtype} {list(ref.shape)}")


def check_same(actual, expected, where):
    """After the load: actual (name -> tensor) holds expected's tensors, bit for bit."""
    check_keys(actual, expected, where)
    for name, t in expected.items():
        if not same_bits(actual[name], t):
            fail(f"{where}[{name!r}] after the load differs from the export's tensor")


def scenario_config(peer, scenarios, scenario):
    if scenario not in scenarios:
        fail(f"{peer}: unknown scenario {scenario!r} (known: {sorted(scenarios)})")
    return scenarios[scenario]


def check_recorded_counter(value, record, name, from_step):
    """The export's counter `value` (a 0-d tensor) is the recorded run's counter.<name> after F."""
    recorded = int(record["counter." + name])
    if int(value) != recorded:
        fail(f"the export's {name} is {int(value)}, the recorded run's after step {from_step} is {recorded}")


def continue_steps(folder, model, from_step, last, update):
    """Steps F+1 .. L: the model set to step K's source.*, then update(K) where step K's called is 1."""
    for step in range(from_step + 1, last + 1):
        record = step_record(folder, step)
        set_model(model, record, step)
        if int(record["called"]):
            update(step)


def peer_tensors(state):
    return {"peer." + k: v.detach().clone() for k, v in state.items()}


def check_steps(folder, from_step):
    meta = load(os.path.join(folder, "meta.pt"), "the scenario's meta.pt")
    if "steps" not in meta:
        fail(f"{folder}/meta.pt has no steps")
    last = int(meta["steps"])
    if not 1 <= from_step <= last:
        fail(f"FROM_STEP {from_step} is outside the scenario's steps 1 .. {last}")
    return last


def luxonis_callback(scenario, folder, export, from_step, last):
    from luxonis_train.callbacks.ema import EMACallback

    if scenario not in LUXONIS_SCENARIOS:
        fail(f"luxonis_callback: unknown scenario {scenario!r} (known: {sorted(LUXONIS_SCENARIOS)})")
    check_keys(export, {"ema_state_dict", "updates"}, "the export")
    check_type(export["updates"], int, "the export's updates")
    model = _common.Net()
    set_model(model, step_record(folder, from_step), from_step)
    check_tensors(export["ema_state_dict"], model.state_dict(), "the export's ema_state_dict")

    callback = EMACallback(**LUXONIS_SCENARIOS[scenario])
    callback.load_state_dict(export)  # what Lightning calls with the callback's checkpoint entry
    callback.on_fit_start(None, model)  # builds the ModelEma, puts the loaded state in (trainer unused)
    ema = callback.ema
    if ema.updates != export["updates"]:
        fail(f"after the load the callback's updates is {ema.updates}, the export's {export['updates']}")
    check_same(ema.state_dict_ema, export["ema_state_dict"], "the callback's ema.state_dict_ema")

    for step in range(from_step + 1, last + 1):
        record = step_record(folder, step)
        set_model(model, record, step)
        if int(record["called"]):
            ema.update(model)
    return {"peer." + k: v.detach().clone() for k, v in ema.state_dict_ema.items()} | \
        {"counter.updates": torch.tensor(ema.updates)}


def nvalchemi_hook(scenario, folder, export, from_step, last):
    import nvalchemi_peer
    from nvalchemi.training._stages import TrainingStage
    from nvalchemi.training.hooks.ema import EMAHook

    if scenario != "resume":
        fail(f"nvalchemi_hook: unknown scenario {scenario!r} (known: ['resume'])")
    kinds = {"decay": float, "update_every": int, "start_step": int, "use_buffers": bool, "num_updates": int,
             "averaged_model_state": dict}
    check_keys(export, kinds, "the export")
    for key, kind in kinds.items():
        check_type(export[key], kind, f"the export's {key}")
    record = step_record(folder, from_step)
    model = _common.Net()
    set_model(model, record, from_step)
    expected = {"module." + k: v for k, v in model.state_dict().items()}
    expected["n_averaged"] = torch.tensor(0, dtype=torch.long)
    check_tensors(export["averaged_model_state"], expected, "the export's averaged_model_state")

    hook = EMAHook(**nvalchemi_peer.RESUME_CONFIG)
    try:
        hook.load_state_dict(export)
    except ValueError as e:  # a config field that differs from the hook's
        fail(f"EMAHook.load_state_dict refused the export: {e}")
    driver = nvalchemi_peer.Driver(model, hook)
    driver.ctx.step_count = int(record["counter.step_count"])  # restored by the strategy's checkpoint
    try:
        hook(driver.ctx, TrainingStage.SETUP)  # TrainingStrategy.run's start: builds and applies the state
    except RuntimeError as e:
        fail(f"EMAHook could not apply the export's averaged_model_state: {e}")
    if hook.num_updates != export["num_updates"]:
        fail(f"after the load the hook's num_updates is {hook.num_updates}, the export's {export['num_updates']}")
    check_same(dict(hook.get_averaged_model().state_dict()), export["averaged_model_state"],
               "the hook's AveragedModel state")

    for step in range(from_step + 1, last + 1):
        record = step_record(folder, step)
        set_model(model, record, step)
        if int(record["called"]):
            driver.batch(bool(int(record["vetoed"])))
    return {"peer." + k: v.detach().clone() for k, v in nvalchemi_peer.averaged(driver).items()} | \
        {"counter." + k: torch.tensor(v) for k, v in nvalchemi_peer.counters(driver).items()}


def lightning(scenario, folder, export, from_step, last):
    import lightning.pytorch as pl
    import lightning_peer
    from lightning.pytorch.callbacks import EMAWeightAveraging

    if scenario != "roundtrip":
        fail(f"lightning: unknown scenario {scenario!r} (known: ['roundtrip'])")
    config = lightning_peer.ROUNDTRIP
    kinds = {"state_dict": dict, "averaging_state": dict, "callbacks": dict, "global_step": int}
    check_keys(export, kinds, "the export")
    for key, kind in kinds.items():
        check_type(export[key], kind, f"the export's {key}")
    if export["global_step"] != from_step:
        fail(f"the export's global_step is {export['global_step']}, FROM_STEP {from_step}")
    check_tensors(export["averaging_state"], {"n_averaged": torch.tensor(0, dtype=torch.long)},
                  "the export's averaging_state")
    check_keys(export["callbacks"], {"EMAWeightAveraging"}, "the export's callbacks")
    entry = export["callbacks"]["EMAWeightAveraging"]
    check_type(entry, dict, "the export's callbacks['EMAWeightAveraging']")
    check_keys(entry, {"latest_update_step"}, "the export's callbacks['EMAWeightAveraging']")
    check_type(entry["latest_update_step"], int, "the export's latest_update_step")

    # The run's own checkpoint at F (a real trainer.save_checkpoint file).
    checkpoints = {}
    for path in sorted(glob.glob(os.path.join(folder, "epoch*.ckpt"))):
        ckpt = torch.load(path, weights_only=True)  # plain data: the scenario's LitNet saves no hyperparameters
        checkpoints[ckpt["global_step"]] = (path, ckpt)
    if from_step not in checkpoints:
        fail(f"no epochE.ckpt of {folder} was saved at global_step {from_step} (they were at {sorted(checkpoints)})")
    path, ckpt = checkpoints[from_step]
    source = prefixed(step_record(folder, from_step), "source.")
    check_same(ckpt["current_model_state"], source, f"{path}'s current_model_state (vs step {from_step}'s source)")
    check_tensors(export["state_dict"], ckpt["state_dict"], "the export's state_dict")
    if "EMAWeightAveraging" not in ckpt["callbacks"]:
        fail(f"{path} has no callbacks['EMAWeightAveraging'] (it has {sorted(ckpt['callbacks'])})")
    ckpt["state_dict"] = export["state_dict"]
    ckpt["averaging_state"] = export["averaging_state"]
    ckpt["callbacks"]["EMAWeightAveraging"] = entry
    ckpt["global_step"] = export["global_step"]

    class Resumed(pl.Callback):
        """After the callback: checks the restored module and average at on_fit_start (the Trainer
        has restored the module and called the callbacks' on_load_checkpoint), global_step at
        on_train_start (it has restored the loops), then each optimizer step's module against the
        record."""

        def __init__(self, ema):
            self.ema, self.last_step, self.record = ema, from_step, None
            self.restored, self.loaded = False, False

        def on_fit_start(self, trainer, module):
            check_same(lightning_peer.state(module), source, "the resumed module (vs step F's source)")
            avg = self.ema._average_model
            check_same(lightning_peer.state(avg.module), export["state_dict"], "the callback's average")
            check_same({"n_averaged": avg.n_averaged}, export["averaging_state"], "the callback's averaging_state")
            if self.ema._latest_update_step != entry["latest_update_step"]:
                fail(f"after the load the callback's latest_update_step is {self.ema._latest_update_step}, "
                     f"the export's {entry['latest_update_step']}")
            self.restored = True

        def on_train_start(self, trainer, module):
            if trainer.global_step != from_step:
                fail(f"the resumed fit starts at global_step {trainer.global_step}, not {from_step}")
            self.loaded = self.restored

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == self.last_step:  # no optimizer step in this batch (accumulation)
                return
            step = trainer.global_step
            if step != self.last_step + 1:
                fail(f"the resumed fit went from global_step {self.last_step} to {step}")
            self.last_step = step
            self.record = lightning_peer.step_record(trainer, module, self.ema, batch_idx)
            recorded = step_record(folder, step)
            for name in ("global_step", "batch_idx", "epoch"):
                if int(self.record["counter." + name]) != int(recorded["counter." + name]):
                    fail(f"step {step} of the resumed fit has {name} {int(self.record['counter.' + name])}, "
                         f"the recorded fit {int(recorded['counter.' + name])}")
            for name, t in prefixed(recorded, "source.").items():
                if not same_bits(self.record["source." + name], t):
                    diff = (self.record["source." + name].double() - t.double()).abs().max().item()
                    fail(f"the resumed fit left the recorded trajectory at step {step}: {name} differs "
                         f"(max |difference| {diff:.3g})")

    ema = EMAWeightAveraging(**config["options"])
    resumed = Resumed(ema)
    with tempfile.TemporaryDirectory() as tmp:
        merged = os.path.join(tmp, "resume.ckpt")
        torch.save(ckpt, merged)
        trainer = lightning_peer.make_trainer(config["epochs"], config["accumulate"], [ema, resumed])
        try:
            trainer.fit(config["module_class"](config["seed"]),
                        lightning_peer.make_loader(config["batches_per_epoch"], config["seed"]), ckpt_path=merged)
        except Failure:
            raise
        except Exception as e:  # noqa: BLE001 - Lightning refused the merged checkpoint
            fail(f"Trainer.fit(ckpt_path=<the checkpoint at {from_step} with the export merged>) failed: "
                 f"{type(e).__name__}: {e}")
    if not resumed.loaded:
        fail("the resumed fit never checked its restored state (on_fit_start, on_train_start)")
    if resumed.last_step != last:
        fail(f"the resumed fit ended at global_step {resumed.last_step}, the recorded one at {last}")
    return {k: v for k, v in resumed.record.items() if k.startswith(("peer.", "counter."))}


def ema_pytorch(scenario, folder, export, from_step, last):
    from ema_pytorch import EMA

    config = scenario_config("ema_pytorch", EMA_PYTORCH_SCENARIOS, scenario)
    model = _common.Net()
    # The state the recorded run made its EMA from (the generator made it at step 0): ema-pytorch
    # never updates its integer buffers, which the export leaves out, so they keep this copy's.
    set_model(model, step_record(folder, 0), 0)
    names = model.state_dict()
    integers = sorted("ema_model." + k for k, v in names.items() if not v.is_floating_point())
    expected = {"ema_model." + k: v for k, v in names.items() if v.is_floating_point()}
    expected |= {"step": torch.tensor(0, dtype=torch.long), "initted": torch.tensor(False)}
    check_tensors(export, expected, "the export")
    record = step_record(folder, from_step)
    check_recorded_counter(export["step"], record, "step", from_step)
    check_recorded_counter(export["initted"], record, "initted", from_step)

    ema = EMA(model, **config)
    try:
        missing, unexpected = ema.load_state_dict(export, strict=False)  # as its users load a file
    except RuntimeError as e:
        fail(f"EMA.load_state_dict(export, strict=False) refused the export: {e}")
    # BatchNorm's loader fills a missing num_batches_tracked with its own (a plain dict has no
    # version metadata), so the integer buffers may or may not be reported missing.
    if unexpected or not set(missing) <= set(integers):
        fail(f"EMA.load_state_dict(export, strict=False) reported missing keys {sorted(missing)} and unexpected "
             f"keys {sorted(unexpected)}; only the integer buffers {integers} may be missing")
    state = ema.state_dict()
    check_same({k: v for k, v in state.items() if k in expected}, export, "the EMA's state")
    check_same({k: v for k, v in state.items() if k in integers},
               {"ema_model." + k: v for k, v in names.items() if "ema_model." + k in integers},
               "the EMA's integer buffers (vs the model it was made from)")
    set_model(model, record, from_step)

    continue_steps(folder, model, from_step, last, lambda step: ema.update())
    # ema_pytorch_peer.py's counters: Python ints, recorded as torch.tensor(int).
    return peer_tensors(ema.ema_model.state_dict()) | \
        {"counter.step": torch.tensor(int(ema.step.item())), "counter.initted": torch.tensor(int(ema.initted.item()))}


def averaged_model(scenario, folder, export, from_step, last):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    config = scenario_config("averaged_model", AVERAGED_MODEL_SCENARIOS, scenario)
    record = step_record(folder, from_step)
    model = _common.Net()
    set_model(model, record, from_step)
    expected = {"module." + k: v for k, v in model.state_dict().items()}
    expected["n_averaged"] = torch.tensor(0, dtype=torch.long)
    check_tensors(export, expected, "the export")
    check_recorded_counter(export["n_averaged"], record, "n_averaged", from_step)

    avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(config["decay"]), use_buffers=config["use_buffers"])
    try:
        avg.load_state_dict(export, strict=True)
    except RuntimeError as e:
        fail(f"AveragedModel.load_state_dict(export, strict=True) refused the export: {e}")
    check_same(dict(avg.state_dict()), export, "the AveragedModel's state")

    continue_steps(folder, model, from_step, last, lambda step: avg.update_parameters(model))
    return peer_tensors(avg.module.state_dict()) | {"counter.n_averaged": torch.tensor(int(avg.n_averaged.item()))}


def timm_v3(scenario, folder, export, from_step, last):
    from timm.utils.model_ema import ModelEmaV3

    config = scenario_config("timm_v3", TIMM_V3_SCENARIOS, scenario)
    model = _common.Net()
    set_model(model, step_record(folder, from_step), from_step)
    check_tensors(export, {"module." + k: v for k, v in model.state_dict().items()}, "the export")

    ema = ModelEmaV3(model, **config)
    try:
        ema.load_state_dict(export, strict=True)
    except RuntimeError as e:
        fail(f"ModelEmaV3.load_state_dict(export, strict=True) refused the export: {e}")
    check_same(dict(ema.state_dict()), export, "the ModelEmaV3's state")

    continue_steps(folder, model, from_step, last, lambda step: ema.update(model, step=step))
    # counter.none: timm_peer.py's placeholder (ModelEmaV3 holds no counter).
    return peer_tensors(ema.module.state_dict()) | {"counter.none": torch.tensor(0)}


def main(argv):
    if len(argv) != 6:
        fail(f"usage: {argv[0]} PEER SCENARIO_DIR EXPORT FROM_STEP OUT_FILE (PEER: {' | '.join(PEERS)})")
    _, peer, folder, export_path, from_text, out_file = argv
    if peer not in PEERS:
        fail(f"unknown PEER {peer!r} (known: {', '.join(PEERS)})")
    if not from_text.isdigit():
        fail(f"FROM_STEP {from_text!r} is not a step number")
    from_step = int(from_text)
    if not os.path.isdir(folder):
        fail(f"SCENARIO_DIR {folder} is not a folder")
    last = check_steps(folder, from_step)
    export = load(export_path, "EXPORT")
    check_type(export, dict, "the export")
    scenario = os.path.basename(os.path.normpath(folder))
    result = globals()[peer](scenario, folder, export, from_step, last)
    result["loaded_from_export"] = torch.tensor(1)
    torch.save(result, out_file)
    print(f"{peer}: loaded the export at step {from_step}, continued to step {last}, wrote {out_file}")


if __name__ == "__main__":
    try:
        main(sys.argv)
    except Failure as e:
        sys.exit(f"_peer_roundtrip.py: {e}")
