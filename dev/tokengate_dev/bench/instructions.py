"""The counter's work on a cold 1k-token chat in CPU instructions, which the load of a
shared machine does not move.

On a 2-core machine shared with other work, CPU time per call swings by a third from run
to run (by half at saturation, where the counter shares its cores with the edge and the
load generator), so a change that saves a tenth cannot be told from noise by timing.
Instruction counts repeat to a tenth of a percent. This runs the counter's code under
valgrind's callgrind, once per part, counting only that part's loop (collection switched
on and off around it with ``callgrind_control``), on the same prompts (TokenStorm's, of
``--seed``, as ``make bench`` sends them):

- ``encode``: tiktoken's ``encode_ordinary`` of each rendered prompt (the floor's
  encode in ``make bench``);
- ``count``: ``tokengate.counter.frames.answer`` on each request, a serialized
  ``CountRequest`` in and a framed ``CountReply`` out: protobuf, JSON, the chat
  template, the encode, the prefix-routing block hashes, the metrics; what a counter
  worker does per call, less its socket and event loop;
- ``hashes``: the prompt's block hashes alone (``prefix_routing.BlockChain``, every
  block new), the part of ``count`` that prefix routing adds;
- ``empty``: the loop with nothing in it (switching collection off is counted once;
  subtracted from the others).

It prints instructions per prompt for each part, ``count``'s ratio to ``encode``, and
``count``'s instructions by shared object. Needs valgrind (Debian's ``valgrind``
package, which brings ``callgrind_control`` and ``callgrind_annotate``); about a minute
per part on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

PARTS = ("empty", "encode", "count", "hashes")


def _collect(on: bool) -> None:
    subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
                   check=True, capture_output=True)


def run_part(part: str, prompts: int, seed: int) -> None:
    """Inside valgrind: prepare ``prompts`` cold chats, then run ``part`` on each with
    instruction collection on."""
    from array import array

    from tokengate import config as tg_config
    from tokengate.counter import frames
    from tokengate.counter.counter_service import TokenCounterService
    from tokengate.counter.counting import ModelCounter
    from tokengate.counter.prefix_routing import BlockChain
    from tokengate.v1 import counter_pb2
    from tokenstorm.prompts import StreamOptions
    from tokenstorm.runner import prompt_builder

    from tokengate_dev import devstack

    cfg = tg_config.load(devstack.ROOT / "tokengate.yaml")
    model = next(iter(cfg.models.values()))
    counter = ModelCounter.load(model, cfg.edge.chat_template_kwargs_allowed)
    service = TokenCounterService({model.name: counter})
    builder = prompt_builder(model.dir, model.name, "chat", seed)
    # a few prompts of their own first: the template's trace and the code paths warm,
    # as in a worker that has served a while
    for i in range(prompts, prompts + 5):
        frames.answer(service.count, counter_pb2.CountRequest(
            endpoint=counter_pb2.ENDPOINT_CHAT, model=model.name,
            body=builder.body(i, 1000, 16, StreamOptions())).SerializeToString())
    encoder = counter.tokenizer._fast
    texts = [builder.render_chat(builder.parts(i, 1000)[1]) for i in range(prompts)]
    if part == "count":
        messages = [counter_pb2.CountRequest(
            endpoint=counter_pb2.ENDPOINT_CHAT, model=model.name,
            body=builder.body(i, 1000, 16, StreamOptions())).SerializeToString()
            for i in range(prompts)]
        _collect(True)
        for m in messages:
            frames.answer(service.count, m)
    elif part == "hashes":
        if encoder is None:
            sys.exit("hashes: the model's tokenizer has no fast path")
        ids = [array("I", encoder.encode_ordinary(t)) for t in texts]
        chain = BlockChain(model.routing.block_size, model.routing.hash_algo,
                           model.routing.hash_seed)
        _collect(True)
        for x in ids:
            chain.hashes(x)
    elif part == "encode":
        if encoder is None:
            sys.exit("encode: the model's tokenizer has no fast path")
        _collect(True)
        for t in texts:
            encoder.encode_ordinary(t)
    else:
        _collect(True)
    _collect(False)


def _totals(out_file: Path) -> int:
    """The instructions collected in ``out_file`` (its ``totals:`` line; ``summary:``
    counts what was collected at the program's start: none here)."""
    for line in out_file.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"{out_file}: no totals line")


def _by_object(out_file: Path) -> Counter[str]:
    """Exclusive instructions of ``out_file`` by shared object (file name)."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100",
                           str(out_file)], check=True, capture_output=True,
                          text=True).stdout
    acc: Counter[str] = Counter()
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)", line)
        if not m or "PROGRAM TOTALS" in line:
            continue
        obj = re.search(r"\[([^\]]+)\]\s*$", m.group(2))
        name = Path(obj.group(1)).name if obj else "python (inlined)"
        acc[name] += int(m.group(1).replace(",", ""))
    return acc


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tokengate_dev.bench.instructions",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=50, metavar="N",
                   help="cold 1k-token chats per part (default: %(default)s)")
    p.add_argument("--seed", type=int, default=4242, help="TokenStorm prompt seed")
    p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.part:
        run_part(a.part, a.prompts, a.seed)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("needs valgrind (apt-get install valgrind)")
    totals: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for part in PARTS:
            print(f"{part}: {a.prompts} prompts under callgrind ...", flush=True)
            out = Path(tmp) / f"{part}.out"
            subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                            f"--callgrind-out-file={out}", sys.executable, "-m",
                            "tokengate_dev.bench.instructions", "--part", part,
                            "--prompts", str(0 if part == "empty" else a.prompts),
                            "--seed", str(a.seed)], check=True, capture_output=True)
            totals[part] = _totals(out)
            if part == "count":
                objects = _by_object(out)
    base = totals["empty"]
    per = {k: (v - base) / a.prompts for k, v in totals.items() if k != "empty"}
    print(f"\ninstructions per cold 1k-token chat ({a.prompts} prompts, seed {a.seed}):")
    for part, n in per.items():
        print(f"  {part:<8}{n / 1e3:>10,.0f} k   {n / per['encode']:.2f}x encode")
    print("count, by shared object:")
    for name, n in objects.most_common(8):
        print(f"  {n / a.prompts / 1e3:>10,.0f} k   {name}")


if __name__ == "__main__":
    main()
