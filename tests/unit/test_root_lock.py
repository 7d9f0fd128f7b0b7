"""One writer per checkpoint root (fp4_dist.checkpoint.lock): a live holder refuses, a dead one's lock is taken
over with a note, another host's is honoured unless overridden, and an unfinished save's leftovers go once the
lock is taken (never before)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from fp4_dist.checkpoint import lock

HOLD = ("import sys, time; from fp4_dist.checkpoint.lock import lock_root; lock_root(sys.argv[1]); "
        "print('held', flush=True); time.sleep(120)")


@pytest.fixture(autouse=True)
def _released(tmp_path):
    yield
    lock.release_root(tmp_path)


def _record(tmp_path, **fields) -> None:
    me = lock.Holder.of_this_process()
    (tmp_path / lock.LOCK).write_text(json.dumps(dict(me.__dict__, **fields)))


def test_a_live_holder_refuses_and_once_killed_its_lock_is_taken_over_with_a_note(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(lock.RootLockedError, match=f"pid {holder.pid} on host {socket.gethostname()}"):
            lock.lock_root(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)  # as the OOM killer would: no exit handler runs, the file stays
        holder.wait()
    assert (tmp_path / lock.LOCK).is_file()
    with pytest.warns(UserWarning, match=f"took over .*, left by pid {holder.pid} on host .*, which has ended"):
        lock.lock_root(tmp_path)
    assert json.loads((tmp_path / lock.LOCK).read_text())["pid"] == lock.Holder.of_this_process().pid


def test_a_lock_of_a_reused_pid_is_stale(tmp_path):
    _record(tmp_path, start_ticks=1)  # this pid, but a process that started at another time
    with pytest.warns(UserWarning, match="which has ended"):
        lock.lock_root(tmp_path)


def test_another_hosts_lock_is_honoured_unless_taken_over(tmp_path):
    _record(tmp_path, host="node-elsewhere", pid=4242)
    left = tmp_path / ".step_00000010.tmp-node-elsewhere-4242-0123abcd"
    left.mkdir()
    with pytest.raises(lock.RootLockedError, match="pid 4242 on host node-elsewhere.*take_over_other_host=True"):
        lock.lock_root(tmp_path)
    assert left.is_dir()  # not the holder: nothing deleted
    with pytest.warns(UserWarning) as caught:
        lock.lock_root(tmp_path, take_over_other_host=True)
    said = [str(w.message) for w in caught]
    assert any("took over" in s and "node-elsewhere" in s for s in said), said
    assert any(f"deleted {left}" in s for s in said) and not left.exists(), said


def test_the_holder_deletes_leftovers_and_puts_back_an_earlier_version_and_releases(tmp_path):
    (tmp_path / ".step_00000004.tmp-h-1-0123abcd").mkdir()
    (tmp_path / ".latest.txt.tmp-h-1-89abcdef").write_text("4")
    old = tmp_path / ".step_00000002.old-h-1-0123abcd"
    old.mkdir()
    (tmp_path / "step_00000006").mkdir()
    with pytest.warns(UserWarning) as caught:
        lock.lock_root(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [lock.LOCK, "step_00000002", "step_00000006"]
    assert len(caught) == 3, [str(w.message) for w in caught]
    lock.lock_root(tmp_path)  # held already: nothing to do
    lock.release_root(tmp_path)
    assert not (tmp_path / lock.LOCK).exists()


def test_a_second_process_is_refused_within_a_second(tmp_path):
    lock.lock_root(tmp_path)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", HOLD, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "RootLockedError" in proc.stderr and "is the checkpoint root of another job" \
        in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 30
