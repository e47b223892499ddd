"""DSpark speculative decoding: the drafter, lossless verification, speculative generation, training.

    from msakit.speculative import DSparkConfig, DSparkDrafter, verify, speculative_generate
    dcfg = DSparkConfig.for_target(target.config, "small")   # or DSparkConfig.preset("minimax-m3.1-flash")
    drafter = DSparkDrafter(dcfg).bind(target)               # shares the target's embedding / head
    tokens = speculative_generate(target, drafter, prompt, 128, temperature=1.0)

Training (`msakit train-drafter`, `msakit.speculative.train`; runs in a folder: `msakit.speculative.runs`):
the target frozen, its tap states captured on the fly, loss 0.1 CE + 0.9 TV + 1.0 BCE(confidence) with
position weights exp(-k / 4).  Text from model folders (`msakit generate`): `msakit.speculative.textgen`.
See docs/spec.md for the design and the verification rules.
"""

from msakit.speculative.config import DRAFTER_PRESETS, DSparkConfig, spread_taps
from msakit.speculative.drafter import DraftProposal, DSparkDrafter
from msakit.speculative.generate import SpecCache, SpecStats, autoregressive_generate, speculative_generate
from msakit.speculative.verify import confidence_budget, sample_probs, sampling_probs, verify

__all__ = [
    "DSparkConfig",
    "DSparkDrafter",
    "DraftProposal",
    "DRAFTER_PRESETS",
    "spread_taps",
    "verify",
    "sampling_probs",
    "sample_probs",
    "confidence_budget",
    "speculative_generate",
    "autoregressive_generate",
    "SpecStats",
    "SpecCache",
]
