"""launch/train.py with test faults (tests/faults.py):

    python tests/fault_train.py SPEC --deepspeed_config ds_configs/zero2.json [train.py arguments]
    deepspeed tests/fault_train.py SPEC ...      # the launcher puts --local_rank=N first
"""

import runpy
import sys
from pathlib import Path

from faults import Faults

from admin_ds.train.hooks import Hooks

if __name__ == "__main__":
    train_main = runpy.run_path(str(Path(__file__).resolve().parents[1] / "launch/train.py"), run_name="launched")["main"]
    args = sys.argv[1:]
    launcher = [a for a in args[:1] if a.startswith("--local_rank")]
    spec, rest = args[len(launcher)], args[len(launcher) + 1:]
    sys.exit(train_main(launcher + rest, hooks=Faults(spec).install(Hooks())))
