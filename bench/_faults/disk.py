"""A full disk under the store-and-forward store (``state_dir`` on a 16 MiB tmpfs).

disk-full:       deferrable requests with no link are stored; the tmpfs is filled
                 to the last byte for a while, then freed; then a node comes up
                 and every receipt must be delivered.
disk-full-flush: a backlog of stored requests; the disk fills, then the link
                 comes back while it is (all but a few pages) full, so the
                 flusher runs into it; then the disk is freed and the whole
                 backlog must be delivered.

16 MiB leaves the store's own growth room (its WAL grows to about 4 MB
before a checkpoint): the fault is the filler file, not the store's size.
Mounting a tmpfs needs root; elsewhere both scenarios are skipped.
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench._faults.harness import (
    Record,
    Result,
    Stream,
    X,
    agent_toml,
    build_repositories,
    fmt_s,
)
from bench._faults.lab import Lab, Skip, drive
from edge.agent import Agent
from tests.support import free_port

INPUTS = {"solo": X}
PAGE = 4096


def _mount_tmpfs(folder: Path, size: str) -> None:
    if os.geteuid() != 0:
        raise Skip("needs root to mount a size-capped tmpfs for the agent's state_dir")
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise Skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def _unmount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def _fill(path: Path, leave_pages: int = 0) -> int:
    """Append to ``path`` until the file system is full, then give back
    ``leave_pages`` pages; returns the file's size."""
    block = b"\0" * PAGE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            try:
                os.write(fd, block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        size = os.fstat(fd).st_size
        if leave_pages:
            size = max(0, size - leave_pages * PAGE)
            os.ftruncate(fd, size)
        return size
    finally:
        os.close(fd)


def _deferred(r: Record) -> bool:
    return r.outcome == "ok" and r.where == "deferred"


def _config(lab: Lab, state: Path) -> tuple[Path, Path, int]:
    cloud, local = build_repositories(lab.workdir)
    port = free_port()  # nothing listens there until the link "comes back"
    config = agent_toml(
        lab.workdir / "agent", local, http=f"http://127.0.0.1:{port}", state_dir=state
    )
    return cloud, config, port


async def _on_tmpfs(lab: Lab, scenario: Callable[[Lab, Path], Awaitable[Result]]) -> Result:
    state = lab.workdir / "state-tmpfs"
    await asyncio.to_thread(_mount_tmpfs, state, "16m")
    try:
        return await scenario(lab, state)
    finally:
        await asyncio.to_thread(_unmount, state)


async def _wait_delivered(agent: Agent, receipts: list[Record], timeout: float) -> dict[int, str]:
    """Receipts (by record index) still not delivered after ``timeout`` s, with their status."""
    left = {r.idx: "?" for r in receipts}
    ids = {r.idx: r.request_id for r in receipts}
    end = time.monotonic() + timeout
    while left and time.monotonic() < end:
        for idx in list(left):
            try:
                status = (await agent.deferred_result(ids[idx]))["status"]
            except Exception as exc:
                status = f"unreadable: {exc!r}"
            if status == "delivered":
                del left[idx]
            else:
                left[idx] = status
        if left:
            await asyncio.sleep(0.25)
    return left


def _mark_undelivered(stream: Stream, undelivered: dict[int, str]) -> None:
    for idx, status in undelivered.items():
        r = stream.records[idx]
        r.outcome = "lost"
        r.detail = f"deferral receipt never delivered (store says {status})"


# ---- no link, the disk fills --------------------------------------------------------------


async def disk_full(lab: Lab) -> Result:
    return await _on_tmpfs(lab, _disk_full)


async def _disk_full(lab: Lab, state: Path) -> Result:
    cloud, config, port = _config(lab, state)

    async def body(stream: Stream, agent: Agent, notes: list[str]) -> float | None:
        await asyncio.sleep(lab.t(2.0, 1.0))
        filler = state / "filler"
        full_at = time.monotonic()
        written = await asyncio.to_thread(_fill, filler)
        await asyncio.sleep(lab.t(3.0, 2.0))
        filler.unlink()
        fault_end = time.monotonic()
        during = [r for r in stream.records if full_at <= r.sent < fault_end]
        codes = sorted({r.code or r.outcome for r in during if not _deferred(r)})
        notes.append(
            f"disk full ({written >> 10} KiB of filler) for {fault_end - full_at:.1f} s: "
            f"{len(during)} requests, {sum(map(_deferred, during))} deferred, the others "
            f"{', '.join(codes) or '-'}"
        )
        recovery = await stream.settle(fault_end, lab.t(10.0, 6.0))
        await asyncio.sleep(lab.t(1.0, 0.5))
        # The link comes back: a node on the agent's port; every receipt must be delivered.
        await stream.stop()
        back = time.monotonic()
        await lab.start_node("late", cloud, "--http-port", str(port))
        receipts = [r for r in stream.records if _deferred(r)]
        undelivered = await _wait_delivered(agent, receipts, lab.t(25.0, 20.0))
        notes.append(
            f"{len(receipts)} receipts; {len(receipts) - len(undelivered)} delivered "
            f"{time.monotonic() - back:.1f} s after the node came up"
        )
        _mark_undelivered(stream, undelivered)
        notes.append(f"deferrals normal again after {fmt_s(recovery)}")
        return recovery

    return await drive(
        lab, "disk-full", config, ["solo"], INPUTS, body,
        rate_hz=10.0, deferrable=True, normal=_deferred,
    )  # fmt: skip


# ---- a backlog, the disk fills, the link comes back -----------------------------------------


async def disk_full_flush(lab: Lab) -> Result:
    return await _on_tmpfs(lab, _disk_full_flush)


async def _disk_full_flush(lab: Lab, state: Path) -> Result:
    cloud, config, port = _config(lab, state)

    async def body(stream: Stream, agent: Agent, notes: list[str]) -> float | None:
        await asyncio.sleep(lab.t(3.0, 2.0))
        await stream.stop()  # the backlog: every request so far is a stored receipt
        receipts = [r for r in stream.records if _deferred(r)]
        filler = state / "filler"
        await asyncio.to_thread(_fill, filler)
        full_at = time.monotonic()
        await lab.start_node("late", cloud, "--http-port", str(port))
        # The flusher finds a link and a disk with a page or a few free, again and again.
        for pages in (1, 2, 3, 4, 2, 3) if not lab.quick else (2, 3, 2, 3):
            await asyncio.to_thread(_fill, filler, pages)
            await asyncio.sleep(1.2)  # the flusher runs every second
        await asyncio.to_thread(_fill, filler)
        counts = await agent.deferrer.counts()
        filler.unlink()
        fault_end = time.monotonic()
        notes.append(
            f"{len(receipts)} receipts stored; the link came back with the disk full, "
            f"{fault_end - full_at:.1f} s later the store held {counts}"
        )
        undelivered = await _wait_delivered(agent, receipts, lab.t(20.0, 12.0))
        drained = time.monotonic() - fault_end
        _mark_undelivered(stream, undelivered)
        if undelivered:
            notes.append(
                f"{len(undelivered)} receipt(s) still undelivered {drained:.1f} s after the disk "
                f"was freed: the store holds {await agent.deferrer.counts()}"
            )
            return None
        notes.append(f"the whole backlog was delivered {drained:.2f} s after the disk was freed")
        return drained

    return await drive(
        lab, "disk-full-flush", config, ["solo"], INPUTS, body,
        rate_hz=10.0, deferrable=True, normal=_deferred,
    )  # fmt: skip
