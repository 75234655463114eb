"""launch/train.py with test faults (tests/faults.py):

    python tests/fault_train.py SPEC --deepspeed_config ds_configs/zero2.json [train.py arguments]
"""

import runpy
import sys
from pathlib import Path

from faults import Faults

from admin_ds.train.hooks import Hooks

if __name__ == "__main__":
    train_main = runpy.run_path(str(Path(__file__).resolve().parents[1] / "launch/train.py"), run_name="launched")["main"]
    sys.exit(train_main(sys.argv[2:], hooks=Faults(sys.argv[1]).install(Hooks())))
