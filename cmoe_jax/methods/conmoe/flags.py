"""The compress command's method flags: ConMoE's group and the settings of any method."""
from __future__ import annotations

from cmoe_jax.cli_args import positive_int
from cmoe_jax.data import Calibration
from cmoe_jax.methods.conmoe.job import CompressConfig, CompressSettings
from cmoe_jax.methods.conmoe.scoring import DISTANCES, SELECTIONS


def add_flags(g) -> None:
    g.add_argument("--scope", type=positive_int, default=1,
                   help="consecutive MoE layers sharing one prototype pool (1: layer-local)")
    g.add_argument("--selection", default="adaptive", choices=SELECTIONS,
                   help="prototype rule: adaptive (a*b score over the scope), fixed "
                        "(per-layer budget), usage, reap (a only), distance (b only)")
    g.add_argument("--distance", default="weights", choices=DISTANCES,
                   help="expert distance d: weights (the paper's gate/up/down distance) or outputs "
                        "(the experts' mean calibration outputs)")


def settings_from_args(args) -> CompressSettings:
    config = CompressConfig(method=args.method, ratio=args.ratio, scope=args.scope,
                            selection=args.selection, distance=args.distance,
                            duplicate_gates=args.duplicate_gates)
    calibration = Calibration(dataset=args.dataset, split=args.split, data_path=args.data_path,
                              samples=args.calib_samples, seqlen=args.seqlen, bos=args.calib_bos)
    return CompressSettings(config, calibration, seed=args.seed, report=args.report)
