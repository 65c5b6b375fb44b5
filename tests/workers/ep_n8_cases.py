"""Worker for tests/test_expert_parallel.py's bounded N = 8 set: the cases of
``ep_cases.CASES_N8`` in one 8-rank world (same records as workers/ep_cases.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import ep_cases  # noqa: E402

if __name__ == "__main__":
    ep_cases.main(sys.argv[1], ep_cases.CASES_N8)
