"""What fp8 features cost the drafter: the demo's recipe trained from its blosc store and from an fp8 store, the
A/B of bench/codec_ab.py with the one codec fp8 (kept for the commands bench/RESULTS.md quotes).

    DFLASH_CACHE=... python bench/fp8_price.py --demo dflash-demo --work /tmp/fp8 --json /tmp/fp8/price.json
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import codec_ab  # noqa: E402

if __name__ == "__main__":
    codec_ab.main([*sys.argv[1:], "--codecs", "fp8"])
