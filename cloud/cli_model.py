"""``ferry-cloud model ...``: inspect, quantize and convert model files.

``cloud.cli`` mounts these with :func:`add_model_commands` and dispatches with
:func:`run_model_command`; ``python -m cloud.cli_model`` runs them alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shared.errors import FerryError, InvalidInput


def add_model_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``model`` command and its sub-commands to a parent parser's subparsers."""
    model = subparsers.add_parser("model", help="inspect, quantize or convert model files")
    sub = model.add_subparsers(dest="model_command", required=True)

    inspect = sub.add_parser("inspect", help="print a model's inputs, outputs and sizes")
    inspect.add_argument("path", type=Path, help="model file, version folder or model folder")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")

    quantize = sub.add_parser("quantize", help="static int8 QDQ quantization of an ONNX model")
    quantize.add_argument("src", type=Path, help="FP32 ONNX model")
    quantize.add_argument("dst", type=Path, help="where to write the int8 model")
    quantize.add_argument(
        "--calibration",
        type=Path,
        metavar="DIR",
        help="folder of input samples, as the model takes them after any preprocessing: "
        ".npy files for a one-input model (one sample, e.g. [3,224,224], or a batch "
        "[N,3,224,224]), .npz files keyed by input name otherwise; finite values only "
        "(default: random data, less accurate)",
    )
    quantize.add_argument("--samples", type=int, default=32, help="calibration samples (32)")
    quantize.add_argument("--batch-size", type=int, default=1, help="calibration batch (1)")
    quantize.add_argument("--no-progress", action="store_true", help="no progress bar")

    convert = sub.add_parser("convert", help="convert a model to another runtime's format")
    convert.add_argument("src", type=Path, help="source model (ONNX)")
    convert.add_argument("--to", required=True, choices=["openvino"], help="target format")
    convert.add_argument(
        "-o",
        "--output",
        type=Path,
        help="output .xml or folder (default: beside the source, same stem)",
    )
    convert.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_model_command(args: argparse.Namespace) -> int:
    """Run the parsed ``model`` sub-command; returns the process exit status."""
    if args.model_command == "inspect":
        from shared.modeltools.inspect import describe, format_description

        description = describe(args.path)
        if args.json:
            print(json.dumps(description, indent=2))
        else:
            print(format_description(description))
        return 0
    if args.model_command == "quantize":
        from shared.modeltools.quantize import quantize_static_qdq

        before = _size(args.src)  # before writing: dst may be src
        with one_line_warnings():
            dst = quantize_static_qdq(
                args.src,
                args.dst,
                args.calibration,
                samples=args.samples,
                batch_size=args.batch_size,
                progress=not args.no_progress,
            )
        _report(args.src, before, dst)
        return 0
    if args.model_command == "convert":
        from shared.modeltools.convert import convert_to_openvino

        before = _size(args.src)
        out = args.output if args.output is not None else args.src.with_suffix(".xml")
        xml = convert_to_openvino(args.src, out, progress=not args.no_progress)
        _report(args.src, before, xml, xml.with_suffix(".bin"))
        return 0
    raise InvalidInput(f"unknown model command {args.model_command!r}")


@contextmanager
def one_line_warnings(prog: str = "ferry-cloud") -> Iterator[None]:
    """Show the model tools' warnings as ``prog: warning: ...`` lines on stderr.

    Python's default format adds the file, line number and source line of
    the call, which means nothing to someone running a command.  Lines go
    through ``tqdm.write`` so they land above a running progress bar.
    """
    from tqdm import tqdm

    from shared.modeltools.calibration import CalibrationWarning

    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if issubclass(category, CalibrationWarning):
            tqdm.write(f"{prog}: warning: {message}", file=sys.stderr)
        else:
            original(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always", CalibrationWarning)
        warnings.showwarning = show
        yield


def _size(path: Path) -> int | None:
    from shared.repository.capacity import model_file_bytes

    return model_file_bytes(path) if path.is_file() else None  # (external weights too)


def _report(src: Path, before: int | None, *outputs: Path) -> None:
    after = sum(p.stat().st_size for p in outputs if p.exists())
    names = " + ".join(str(p) for p in outputs)
    if before is None:
        print(f"wrote {names}: {after:,} bytes")
        return
    print(
        f"wrote {names}: {after:,} bytes ({src.name}: {before:,} bytes, {before / max(after, 1):.2f}x)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ferry-cloud")
    add_model_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return run_model_command(args)
    except FerryError as exc:
        print(f"ferry-cloud: error [{exc.code.value}]: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
