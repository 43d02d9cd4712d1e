"""Top-1 agreement of the example repository's variants with its FP32 model.

Quantizing to int8 and converting to OpenVINO must not change what the
model answers; this measures how often each variant's top-1 class matches
the FP32 ONNX Runtime model on rendered pages (held out from the int8
variant's calibration pages, which use seed 0).  Every variant runs through
:func:`shared.runtimes.load_session`, the path Ferry serves with, so the
figure covers Ferry's backends and not just the raw runtimes.

    python -m shared.modeltools.agreement [examples/repository] [--samples 32] [--seed 1]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.runtimes import RuntimeOptions, load_session


@dataclass(frozen=True)
class Variant:
    """One way of running the model: a repository file, a backend and its precision."""

    label: str
    backend: str
    file: str  # relative to the repository
    precision_hint: str | None = None


VARIANTS: tuple[Variant, ...] = (
    Variant("orientation", "onnxruntime", "orientation/1/model.onnx"),
    Variant("orientation-int8", "onnxruntime", "orientation-int8/1/model.onnx"),
    Variant("orientation-ov f32", "openvino", "orientation-ov/1/model.xml", "f32"),
    Variant("orientation-ov default", "openvino", "orientation-ov/1/model.xml"),
)
REFERENCE = "orientation"


def top1_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Share of rows whose argmax is the same in ``a`` and ``b``."""
    return float(np.mean(a.argmax(1) == b.argmax(1)))


def variant_outputs(
    repository: Path, images: np.ndarray, *, batch: int = 8, threads: int = 2
) -> dict[str, np.ndarray]:
    """Each variant's scores for ``images``, in batches of ``batch``."""
    outputs: dict[str, np.ndarray] = {}
    for variant in VARIANTS:
        options = RuntimeOptions(threads=threads, precision_hint=variant.precision_hint)
        session = load_session(variant.backend, Path(repository) / variant.file, options)
        try:
            x, y = session.inputs[0].name, session.outputs[0].name
            outputs[variant.label] = np.concatenate(
                [
                    session.run({x: images[i : i + batch]}, [y])[y]
                    for i in range(0, len(images), batch)
                ]
            )
        finally:
            session.close()
    return outputs


@dataclass(frozen=True)
class AgreementReport:
    samples: int
    accuracy: float  # the FP32 model against the pages' true labels
    agreement: dict[str, float]  # variant -> top-1 agreement with the FP32 model
    drift: dict[str, float]  # variant -> max |score difference| from the FP32 model

    @classmethod
    def from_outputs(cls, outputs: dict[str, np.ndarray], labels: np.ndarray) -> AgreementReport:
        reference = outputs[REFERENCE]
        others = [name for name in outputs if name != REFERENCE]
        return cls(
            samples=len(labels),
            accuracy=float(np.mean(reference.argmax(1) == labels)),
            agreement={n: top1_agreement(outputs[n], reference) for n in others},
            drift={n: float(np.abs(outputs[n] - reference).max()) for n in others},
        )

    def lines(self) -> list[str]:
        out = [
            f"top-1 agreement with fp32 ONNX Runtime on {self.samples} rendered pages "
            f"(fp32 accuracy {self.accuracy:.1%}):"
        ]
        for name, share in self.agreement.items():
            out.append(f"  {name:<24} {share:6.1%}   max |dp| {self.drift[name]:.4f}")
        return out


def agreement_report(repository: Path, samples: int = 32, seed: int = 1) -> AgreementReport:
    """Render ``samples`` pages with ``seed`` and compare every variant on them."""
    from shared.modeltools.samples import orientation_samples

    images, labels = orientation_samples(samples, seed=seed)
    return AgreementReport.from_outputs(variant_outputs(repository, images), labels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repository", type=Path, nargs="?", default=Path("examples/repository"))
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1, help="page seed (0 is the calibration set)")
    args = parser.parse_args(argv)
    print("\n".join(agreement_report(args.repository, args.samples, args.seed).lines()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
