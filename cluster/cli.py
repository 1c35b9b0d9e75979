"""The ``rayrlhf`` command: ``rayrlhf train CONFIG [--set section.key=value ...]``."""

from __future__ import annotations

import argparse
import logging
import sys

from cluster.config import ConfigError, config_help, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rayrlhf", description="RL post-training of language models on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="run a training job (starts or joins a Ray cluster)")
    tr.add_argument("config", nargs="?", help="YAML preset, e.g. configs/ppo_smollm2.yaml (default: built-in defaults)")
    tr.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, e.g. --set run.steps=5 (repeatable)")
    tr.add_argument("--run-dir", default=None, help="exact run directory (default: <output_dir>/<name>-<timestamp>)")
    sub.add_parser("config", help="print every config field with its default and meaning")
    va = sub.add_parser("validate", help="check a config file without running it")
    va.add_argument("config")
    va.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "config":
        print(config_help())
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"rayrlhf: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "validate":
        print("config OK")
        return 0
    from cluster.driver import train

    train(cfg, run_dir=args.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
