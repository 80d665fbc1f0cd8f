"""The training example (examples/train_copy.py) learns: a short run's loss falls."""

import importlib.util
import math
import os

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "train_copy.py")


def test_copy_task_loss_falls():
    spec = importlib.util.spec_from_file_location("train_copy", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    losses = mod.train(steps=120, log_every=0)
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    # Chance level is ln 16 = 2.77; the model must learn well beyond it.
    assert first > 2.5
    assert last < first - 0.5, f"loss did not fall enough: {first:.3f} -> {last:.3f}"
