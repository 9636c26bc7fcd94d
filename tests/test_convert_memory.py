"""Peak host memory of a streaming conversion is a few layers, not the model.

A 16-layer checkpoint with big-ish bf16 experts (64 experts x 3 x [1024, 64]: 25.2 MB per layer, 400 MB
in all) is converted in a fresh process. Bound on what the conversion's data adds to resident memory:
4 x one layer + 48 MB (one layer stacked by the builder, up to two more transiently inside orbax /
tensorstore while the item is written, plus slack: at 12 layers the peak moved between 108 and 133 MB from run
to run, once past 32 MB of slack). Loading the model whole would need 400 MB.
"""

import json
import subprocess
import sys

from tests import convert_fixtures as fx
from tests.convert_fixtures import REPO

DIMS = dict(hidden_size=64, n_routed_experts=64, moe_intermediate_size=1024, first_k_dense_replace=0, num_experts_per_tok=4)
LAYERS = 16
MB = 2**20


def test_peak_rss_stays_near_one_layer(tmp_path):
    warm, big = tmp_path / "warm", tmp_path / "big"
    warm.mkdir()
    big.mkdir()
    fx.synthetic_checkpoint(warm, num_hidden_layers=1, **DIMS)
    fx.synthetic_checkpoint(big, num_hidden_layers=LAYERS, **DIMS)
    total = sum(p.stat().st_size for p in big.glob("*.safetensors"))
    layer = (big / "layer_003.safetensors").stat().st_size
    assert total > 10 * layer

    r = subprocess.run([sys.executable, "-m", "tests.convert_memory_probe", str(warm), str(big), str(tmp_path / "out")],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    added = (m["big_peak_kb"] - m["rss_before_big_kb"]) * 1024
    bound = 4 * layer + 48 * MB
    print(f"\nconversion peak adds {added / MB:.1f} MB for {LAYERS} layers of {layer / MB:.1f} MB "
          f"({total / MB:.0f} MB total); bound {bound / MB:.1f} MB")
    assert added <= bound, (added / MB, bound / MB)
    assert added < total / 2
    assert (tmp_path / "out" / "big" / "CONVERSION_COMPLETE").exists()
