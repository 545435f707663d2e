"""Conformance data from luxonis-train's ModelEma (see _common.py for the format), where the
package installs. It pins an older torch than the venv's and pulls in some 200 packages, so the
test command does not install it: without it this reports itself skipped."""
import sys

import _common

out = sys.argv[1]
try:
    from luxonis_train.callbacks.ema import ModelEma
except Exception as e:
    _common.skipped(out, f"luxonis-train is not installed here ({type(e).__name__}: {e}); "
                         "it pins an older torch than the venv's, so the test command does not install it")


def update(ema, model, step):
    ema.update(model)


_common.run(out, "dynamic_decay", make=lambda m: ModelEma(m, decay=0.99, decay_tau=5.0), update=update,
            peer_state=lambda e: dict(e.state_dict_ema), counters=lambda e: {"updates": e.updates}, steps=30)
