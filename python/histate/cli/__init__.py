"""`histate` command line: `histate replay` answers "what hit rate and TTFT would each cache policy
give on my trace, with my GPU/CPU/SSD budgets?" (docs/results.md shows the paper preset);
`histate bench` measures the same workload on a live server, `histate compare` puts runs side by side
and `histate serve` is a CPU server (the reference executor) to bench against (docs/bench.md).

One module per job: argparse types (arg_types), the parser (parser), flags to a checked run (plan),
and one module per verb."""
from __future__ import annotations

from histate.cli.parser import build_parser


def main(argv=None) -> int:
    from histate.cli.bench import bench_command, compare_command
    from histate.cli.cluster import cluster_command
    from histate.cli.replay import replay_command
    from histate.cli.serve import serve_command

    args = build_parser().parse_args(argv)
    commands = {"replay": replay_command, "bench": bench_command, "compare": compare_command,
                "serve": serve_command, "cluster": cluster_command}
    return commands[args.command](args)
