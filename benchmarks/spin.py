"""CPU the runtime's intra-op threads burn between runs: spinning allowed within a run, stopped
when it returns (`colembed.sessions.RUN_THREAD_CONFIG`), against spinning left on.

    python -m benchmarks.spin [--pause 0.2] [--rounds 20]

Runs a 256x512 @ 512x512 MatMul session of 2 threads a few times, then sleeps `--pause` seconds
and reports the process CPU time spent during the pause (median over `--rounds`), for the
runtime's configuration and for `session.force_spinning_stop` 0. A timing, so it lives here and
not in tests/ (tests/runtime/test_speed_rules.py checks the configuration itself).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def matmul_graph() -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 512])],
        [numpy_helper.from_array(weight, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def cpu_in_pause(session_config: dict[str, str] | None, pause: float, rounds: int) -> float:
    """Median process CPU seconds spent while sleeping `pause` s right after three runs."""
    from colembed.sessions import Session

    session = Session(matmul_graph(), threads=2, session_config=session_config)
    x = np.ones((256, 512), np.float32)
    spent = []
    for _ in range(rounds):
        for _ in range(3):
            session.run({"x": x})
        start = time.process_time()
        time.sleep(pause)
        spent.append(time.process_time() - start)
    return statistics.median(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pause", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    figures = {
        "runtime (spinning stops after a run)": cpu_in_pause(None, args.pause, args.rounds),
        "spinning left on": cpu_in_pause(
            {"session.force_spinning_stop": "0"}, args.pause, args.rounds
        ),
    }
    print(json.dumps({"pause_s": args.pause, "cpu_s_in_pause": figures}, indent=1))


if __name__ == "__main__":
    main()
