"""Streaming statistics with O(1) memory: EWMA and the P-square quantile.

P-square (Jain & Chlamtac, CACM 1985) keeps five markers whose heights
track the quantile with parabolic interpolation; reads are plain attribute
lookups, which is what the per-request policy needs.
"""

from __future__ import annotations

from typing import Any


class Ewma:
    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.value: float | None = None
        self.count = 0

    def add(self, x: float) -> None:
        self.count += 1
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)

    def to_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "value": self.value, "count": self.count}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ewma:
        e = cls(float(d.get("alpha", 0.2)))
        value = d.get("value")
        e.value = float(value) if value is not None else None  # ("x" raises here, not later)
        e.count = int(d.get("count", 0))
        return e


class P2Quantile:
    def __init__(self, q: float) -> None:
        if not 0 < q < 1:
            raise ValueError(f"quantile must be in (0, 1), got {q}")
        self.q = q
        self.count = 0
        self._init: list[float] = []
        self._h: list[float] = []  # marker heights
        self._n: list[int] = []  # marker positions
        self._np: list[float] = []  # desired positions
        self._dn = [0.0, q / 2, q, (1 + q) / 2, 1.0]

    @property
    def value(self) -> float | None:
        if self.count == 0:
            return None
        if self.count <= 5:
            data = sorted(self._init)
            idx = min(len(data) - 1, max(0, round(self.q * (len(data) - 1))))
            return data[idx]
        return self._h[2]

    def add(self, x: float) -> None:
        self.count += 1
        if self.count <= 5:
            self._init.append(x)
            if self.count == 5:
                self._h = sorted(self._init)
                self._n = [1, 2, 3, 4, 5]
                q = self.q
                self._np = [1, 1 + 2 * q, 1 + 4 * q, 3 + 2 * q, 5]
            return
        h, n = self._h, self._n
        if x < h[0]:
            h[0] = x
            k = 0
        elif x >= h[4]:
            h[4] = x
            k = 3
        else:
            k = 0
            while k < 3 and x >= h[k + 1]:
                k += 1
        for i in range(k + 1, 5):
            n[i] += 1
        for i in range(5):
            self._np[i] += self._dn[i]
        for i in (1, 2, 3):
            d = self._np[i] - n[i]
            if (d >= 1 and n[i + 1] - n[i] > 1) or (d <= -1 and n[i - 1] - n[i] < -1):
                s = 1 if d > 0 else -1
                hp = self._parabolic(i, s)
                if not h[i - 1] < hp < h[i + 1]:
                    hp = h[i] + s * (h[i + s] - h[i]) / (n[i + s] - n[i])
                h[i] = hp
                n[i] += s

    def _parabolic(self, i: int, s: int) -> float:
        h, n = self._h, self._n
        return h[i] + s / (n[i + 1] - n[i - 1]) * (
            (n[i] - n[i - 1] + s) * (h[i + 1] - h[i]) / (n[i + 1] - n[i])
            + (n[i + 1] - n[i] - s) * (h[i] - h[i - 1]) / (n[i] - n[i - 1])
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "q": self.q,
            "count": self.count,
            "init": self._init,
            "h": self._h,
            "n": self._n,
            "np": self._np,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> P2Quantile:
        p = cls(float(d["q"]))
        p.count = int(d.get("count", 0))
        p._init = [float(x) for x in d.get("init", [])]
        p._h = [float(x) for x in d.get("h", [])]
        p._n = [int(x) for x in d.get("n", [])]
        p._np = [float(x) for x in d.get("np", [])]
        if p.count > 5 and (len(p._h) != 5 or len(p._n) != 5 or len(p._np) != 5):
            raise ValueError("corrupt P2 state")
        return p
