"""The ``rayrlhf`` command.

    rayrlhf train CONFIG [--set section.key=value ...]      a new run
    rayrlhf train --resume RUN_DIR [--set run.steps=N ...]  continue a run from its latest checkpoint
    rayrlhf config [--schema]                               every field, its default and meaning
    rayrlhf validate CONFIG [--set ...]                     check a config without running it
    rayrlhf status RUN_DIR [--json]                         step, reward, checkpoint, prompt ledger of a run
    rayrlhf data inspect [SOURCE] [--config C] [--set ...]  the prompts as the model will see them, skips counted
    rayrlhf serve policy|scorer|reload ...                  Ray Serve apps (serving/cli.py)

User errors (a bad config key, a missing prompt file, an unknown task, a reward function that
does not import, a model folder that does not exist) end with one line and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from actors.start_up import lighter_gc
from cluster.config import ConfigError, UserError
from cluster.config.help import config_help, config_schema
from cluster.config.loading import check_resume_compatible, load_config, read_yaml


def _resume_config(run_dir: str, config: str | None, overrides: list[str]):
    saved_file = Path(run_dir) / "config.yaml"
    if not saved_file.is_file():
        raise UserError(f"--resume {run_dir}: not a run directory (no config.yaml)")
    saved = load_config(saved_file)
    cfg = load_config(config, overrides) if config else load_config(overrides=overrides, base=read_yaml(saved_file))
    check_resume_compatible(saved, cfg)
    return cfg


def build_parser() -> argparse.ArgumentParser:
    """The ``rayrlhf`` command line (the docs' commands are checked against it: tests/unit/test_docs.py)."""
    parser = argparse.ArgumentParser(prog="rayrlhf", description="RL post-training of language models on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="run a training job (starts or joins a Ray cluster)")
    tr.add_argument(
        "config",
        nargs="?",
        help="YAML preset, e.g. configs/ppo_smollm2.yaml (default: built-in defaults, or the resumed run's config)",
    )
    tr.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set run.steps=5 (repeatable)",
    )
    tr.add_argument("--run-dir", default=None, help="exact run directory (default: <output_dir>/<name>-<timestamp>)")
    tr.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue RUN_DIR from its latest checkpoint (its config, with --set changes)",
    )
    tr.add_argument(
        "--dry-run",
        action="store_true",
        help="load and check the config (and --resume's), print it as the run would use it, start nothing",
    )
    tr.add_argument(
        "--verbose",
        action="store_true",
        help="show every library's output on the console too (it is always in <run dir>/train.log)",
    )
    st = sub.add_parser("status", help="summarise a run: step, reward, last checkpoint, prompt ledger")
    st.add_argument("run_dir")
    st.add_argument("--json", action="store_true", help="print the summary as JSON")
    co = sub.add_parser("config", help="print every config field with its default and meaning")
    co.add_argument("--schema", action="store_true", help="print the JSON schema instead")
    co.add_argument(
        "--markdown", action="store_true", help="print the reference as Markdown (docs/reference/config.md)"
    )
    va = sub.add_parser("validate", help="check a config file without running it")
    va.add_argument("config")
    va.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    da = sub.add_parser("data", help="look at a run's data as the model will see it")
    da_sub = da.add_subparsers(dest="data_command", required=True)
    di = da_sub.add_parser(
        "inspect", help="the first prompts after the chat template, token counts, rows skipped and why"
    )
    di.add_argument("source", nargs="?", help="a task name or data file/folder (replaces data.task / data.mix)")
    di.add_argument("--config", default=None, help="the run's YAML preset (keys, mixture, model, budgets)")
    di.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    di.add_argument("--rows", type=int, default=3, help="rows shown per split (default 3)")
    di.add_argument("--json", action="store_true", help="every row with its token ids, as JSON")
    from serving.cli import add_parser as add_serve_parser

    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    lighter_gc()  # before the driver's heavy imports (actors/start_up.py)
    args = build_parser().parse_args(argv)

    if args.command == "train":
        return _train(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "status":
        from cluster.ops.status import main as status

        return status(args.run_dir, as_json=args.json)
    if args.command == "serve":
        from serving.cli import run as serve

        return serve(args)
    if args.command == "data":
        return _data(args)
    if args.command == "config":
        from cluster.config.help import config_markdown

        print(config_schema() if args.schema else config_markdown() if args.markdown else config_help())
        return 0
    try:
        load_config(args.config, args.overrides)
    except (ConfigError, UserError) as e:
        print(f"rayrlhf: config error: {e}", file=sys.stderr)
        return 2
    print("config OK")
    return 0


def _data(args: argparse.Namespace) -> int:
    from cluster.data.inspection import main as inspect

    try:
        return inspect(args.config, args.overrides, args.source, args.rows, args.json)
    except (ConfigError, UserError) as e:
        print(f"rayrlhf: {e}", file=sys.stderr)
        return 2


def _train(args: argparse.Namespace) -> int:
    """``rayrlhf train``: on a quiet console (rayrlhf's lines; the rest in <run dir>/train.log)."""
    if args.dry_run:
        return _dry_run(args)
    from cluster.ops import console

    con = console.active = console.Console(verbose=args.verbose).install()
    try:
        if args.resume:
            if args.run_dir:
                raise ConfigError("--resume names the run directory already; drop --run-dir")
            cfg = _resume_config(args.resume, args.config, args.overrides)
        else:
            cfg = load_config(args.config, args.overrides)
        from cluster.driver import train

        train(cfg, run_dir=args.resume or args.run_dir, resume=bool(args.resume))
    except ConfigError as e:
        print(f"rayrlhf: config error: {e}", file=sys.stderr)
        return 2
    except UserError as e:
        print(f"rayrlhf: {e}", file=sys.stderr)
        return 2
    except BaseException as e:  # the traceback goes to the terminal and the log, not through the filter
        import traceback

        text = traceback.format_exc()
        con.log.write(text)
        where = f" (log: {con.log.path})" if con.log.path else ""
        print(text + f"rayrlhf: the run failed: {e!r}{where}", file=con.real_stderr, flush=True)
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    finally:
        con.close()
        console.active = None
    return 0


def _dry_run(args: argparse.Namespace) -> int:
    """``rayrlhf train --dry-run``: the config the run would use, as YAML (stages included), or
    the one-line error it would stop with; no cluster, no data, no model."""
    import yaml

    try:
        cfg = (
            _resume_config(args.resume, args.config, args.overrides)
            if args.resume
            else load_config(args.config, args.overrides)
        )
    except (ConfigError, UserError) as e:
        print(f"rayrlhf: config error: {e}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
