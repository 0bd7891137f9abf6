"""`histate serve`: the CPU reference executor behind SGLang's /generate, and its L3 flags."""
from __future__ import annotations

import sys


def _l3_settings(args) -> dict:
    """ServeConfig's L3 fields from the flags; the L3 flags without --l3-master are an error, not ignored."""
    if args.l3_master is None:
        given = [flag for flag, value in (("--l3-key-prefix", args.l3_key_prefix != "histate"),
                                          ("--l3-pin-ttl-s", args.l3_pin_ttl_s is not None)) if value]
        if given:
            raise ValueError(f"{', '.join(given)}: needs --l3-master")
        return {}
    settings = {"l3_master": args.l3_master, "l3_key_prefix": args.l3_key_prefix}
    if args.l3_pin_ttl_s is not None:
        settings["l3_pin_ttl_s"] = args.l3_pin_ttl_s
    return settings


def serve_command(args) -> int:
    from histate.core import Tier

    MiB = 2**20
    try:
        from histate.serve.engine import ServeConfig, ServingEngine
        from histate.serve.http import run_forever

        config = ServeConfig(args.policy, {Tier.GPU: int(args.gpu_mib * MiB), Tier.CPU: int(args.cpu_mib * MiB),
                                           Tier.SSD: int(args.ssd_mib * MiB)},
                             args.ssd_dir, args.ssd_backend, args.max_context, check_mirror=args.check_mirror,
                             num_threads=args.threads, **_l3_settings(args))
        engine = ServingEngine(config)
    except (ValueError, OSError, ImportError) as err:
        print(f"histate serve: error: {err}", file=sys.stderr)
        return 2
    info = engine.info()
    print(f"histate serve: policy {args.policy}, {info['model_path']}, vocab {info['vocab_size']}, "
          f"http://{args.host}:{args.port}", flush=True)
    try:
        run_forever(engine, args.host, args.port)
    except OSError as err:
        print(f"histate serve: error: {err}", file=sys.stderr)
        return 2
    finally:
        engine.close()
    return 0
