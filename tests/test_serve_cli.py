"""``pluginhost serve`` as an operator runs it: a real process on 127.0.0.1, stopped by a signal.

Each test starts the command with ``--port 0`` (the kernel picks a free port;
the URL printed on stderr says which), bounds every wait, and kills the
process if it outlives the test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from pluginhost.testing.server import served_url, wait_until

TIMEOUT = 60


@contextmanager
def serving(*args: str, env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """``pluginhost serve --port 0 ARGS`` until its URL is printed; always ended afterwards."""
    process = subprocess.Popen(
        [sys.executable, "-m", "pluginhost", "serve", "--port", "0", "--no-plugins", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,  # its own process group, which a test may signal as a whole
    )
    lines: list[str] = []
    try:
        url, lines = served_url(process, TIMEOUT)
        assert url, "".join(lines)
        process.stderr_lines = lines  # type: ignore[attr-defined]  # so far, growing; all of it once ended
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        rest = process.communicate(timeout=TIMEOUT)[1]  # what it wrote after its URL, up to its exit
        process.stderr_lines = [*lines, rest or ""]  # type: ignore[attr-defined]


def test_serves_the_demo_model_and_exits_0_on_sigterm():
    with serving() as (process, url):
        assert url.startswith("http://127.0.0.1:")
        # Which model, dtype and device: what an operator checks first ("auto" decided by now).
        banner = next(line for line in process.stderr_lines if "pluginhost: serving" in line)
        assert banner.startswith(f"pluginhost: serving 'demo' (OPTForCausalLM, float32 on cpu) at {url} ")
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
        models = httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()
        assert [m["id"] for m in models["data"]] == ["demo"]
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "demo", "messages": [{"role": "user", "content": "What is a plugin?"}], "max_tokens": 30},
            timeout=TIMEOUT,
        ).json()
        assert len(chat["choices"][0]["message"]["content"].split()) > 3  # words, from a model that knows its docs
        # A page of another site whose name now points at 127.0.0.1 (DNS rebinding) sends its own name: it was
        # served, so any web page could use a server meant for this machine only.
        port = url.rsplit(":", 1)[1]
        rebound = httpx.get(f"{url}/v1/models", headers={"Host": f"attacker.example:{port}"}, timeout=TIMEOUT)
        assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "invalid_host"
        for name in ("localhost", "LOCALHOST.", "api.localhost", "127.0.0.1", "[::1]"):
            assert httpx.get(f"{url}/health", headers={"Host": f"{name}:{port}"}, timeout=TIMEOUT).status_code == 200
        metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text  # a refused Host is counted as any answer
        assert 'pluginhost_http_requests_total{model_name="demo",route="unmatched",status="400"} 1.0' in metrics
        process.send_signal(signal.SIGTERM)
        assert process.wait(TIMEOUT) == 0


@pytest.mark.parametrize("grace", ["0", "2"])
def test_sigint_ends_a_request_in_flight_and_exits_0(grace):
    """The stream in flight ends as the API says (its last chunk, then [DONE]), not cut off mid-body."""
    with serving("--shutdown-timeout", grace) as (process, url):
        body = {"model": "demo", "prompt": "A plugin is", "max_tokens": 240, "ignore_eos": True, "stream": True}
        received = []
        started = time.monotonic()
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
            for line in response.iter_lines():
                if not line:
                    continue  # the blank line after each event
                received.append(line)
                if len(received) == 2:  # once: a second Ctrl-C means "quit now"
                    process.send_signal(signal.SIGINT)
        assert process.wait(TIMEOUT) == 0
        assert time.monotonic() - started < 30
    assert received[-1] == "data: [DONE]"
    last = json.loads(received[-2].removeprefix("data: "))["choices"][0]
    # No grace: aborted at once. Two seconds: the demo model may finish its 240 tokens first, or be aborted.
    assert last["finish_reason"] == "abort" if grace == "0" else last["finish_reason"] in ("length", "abort")
    stderr = "".join(process.stderr_lines)  # type: ignore[attr-defined]
    assert "Traceback" not in stderr and "Cancel" not in stderr, stderr  # uvicorn's "Cancel N running task(s)"


def exit_on_signal(process: subprocess.Popen, signum: int, *, once: Path) -> str:
    """Send ``signum`` once the file ``once`` exists; assert the process exits 0, and return its stderr."""
    try:
        assert wait_until(lambda: once.exists() or process.poll() is not None, TIMEOUT)
        process.send_signal(signum)
        assert process.wait(TIMEOUT) == 0
    finally:
        if process.poll() is None:
            process.kill()
        stderr = process.communicate(timeout=TIMEOUT)[1]
    return stderr


def serving_slowly(install_plugin, loading: Path, seconds: float, *args: str) -> subprocess.Popen:  # noqa: ANN001
    """``pluginhost serve ARGS`` with a plugin whose ``pre_load`` creates the file ``loading``, then sleeps."""
    install_plugin(
        "slow_load",
        f"""
        import pathlib, time
        from pluginhost import hookimpl

        @hookimpl
        def pre_load(config, model_class):
            pathlib.Path({str(loading)!r}).touch()
            time.sleep({seconds})
        """,
    )
    return subprocess.Popen(
        [sys.executable, "-m", "pluginhost", "serve", *args, "--plugins", "slow_load"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        start_new_session=True,
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_model_loads_exits_0_saying_it_never_served(install_plugin, tmp_path, signum):
    """As documented for SIGINT and SIGTERM: exit 0 (SIGTERM killed it silently with -15, SIGINT exited 130)."""
    loading = tmp_path / "loading"
    process = serving_slowly(install_plugin, loading, TIMEOUT, "--port", "0")  # still loading when the signal comes
    stderr = exit_on_signal(process, signum, once=loading)
    name = signal.Signals(signum).name
    assert (
        stderr.strip().splitlines()[-1] == f"pluginhost: stopped by {name} before serving (the model was still loading)"
    )
    assert "Traceback" not in stderr and "terminate called" not in stderr, stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_after_the_model_loaded_and_before_the_server_listens_exits_0(tmp_path, signum):
    """The moment between the two (uvicorn's settings being made): SIGTERM killed it with -15, SIGINT exited 130."""
    window = tmp_path / "window"
    script = f"""
import pathlib, sys, time, uvicorn
made = uvicorn.Config.__init__
def slowly(self, *args, **kwargs):
    pathlib.Path({str(window)!r}).touch()
    time.sleep({TIMEOUT})  # the signal comes now
    made(self, *args, **kwargs)
uvicorn.Config.__init__ = slowly
from pluginhost.cli import run
sys.argv = ["pluginhost", *sys.argv[1:]]
run()
"""
    process = subprocess.Popen(
        [sys.executable, "-c", script, "serve", "--port", "0", "--no-plugins"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    stderr = exit_on_signal(process, signum, once=window)
    name = signal.Signals(signum).name
    assert stderr.strip().splitlines()[-1] == f"pluginhost: stopped by {name} as the server started or ended"
    assert "Traceback" not in stderr, stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_torch_imports_stops_the_server_before_it_serves(signum, signal_as_torch_imports_numpy):
    """Ctrl-C or SIGTERM in the first second: torch's import swallowed it, and the server went on to serve."""
    name = signal.Signals(signum).name
    process = subprocess.Popen(
        [sys.executable, "-c", signal_as_torch_imports_numpy, "serve", "--port", "0", "--no-plugins"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "SIGNAL": name},
        start_new_session=True,
    )
    try:
        url, lines = served_url(process, TIMEOUT)  # None once the process has ended
        assert url is None, f"the {name} was lost: it serves at {url}"
        assert process.wait(TIMEOUT) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(TIMEOUT)
    stderr = "".join(lines)
    assert (
        stderr.strip().splitlines()[-1] == f"pluginhost: stopped by {name} before serving (the model was still loading)"
    )
    assert "Traceback" not in stderr and "error" not in stderr, stderr


def test_a_second_ctrl_c_aborts_every_request_and_each_answer_still_ends_as_the_api_says():
    """Ctrl-C twice: requests are aborted at once, not cancelled (plain-text 500s and a traceback for each)."""
    with serving("--max-num-seqs", "1", "--shutdown-timeout", "60") as (process, url):
        body = {"model": "demo", "prompt": "A plugin is", "max_tokens": 250, "ignore_eos": True}
        answers: dict[int, httpx.Response] = {}

        def ask(i: int) -> None:
            answers[i] = httpx.post(f"{url}/v1/completions", json={**body, "stream": i % 2 == 1}, timeout=TIMEOUT)

        askers = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for asker in askers:
            asker.start()

        def in_engine() -> float:  # sequences running and waiting, as /metrics says
            text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
            lines = [
                x
                for x in text.splitlines()
                if x.startswith(("pluginhost_num_requests_running{", "pluginhost_num_requests_waiting{"))
            ]
            return sum(float(x.rsplit(" ", 1)[1]) for x in lines)

        assert wait_until(lambda: in_engine() == 4, TIMEOUT)
        process.send_signal(signal.SIGINT)  # the first: graceful, 60 s for the requests
        assert wait_until(lambda: _refused(url), TIMEOUT)  # it stopped accepting: the first one was handled
        process.send_signal(signal.SIGINT)
        assert process.wait(TIMEOUT) == 0
        for asker in askers:
            asker.join(TIMEOUT)
    assert sorted(answers) == [0, 1, 2, 3]
    reasons = []
    for i, answer in answers.items():
        assert answer.status_code == 200, answer.text
        if i % 2 == 0:
            reasons += [c["finish_reason"] for c in answer.json()["choices"]]
        else:
            events = answer.text.split("\n\n")
            assert events[-2:] == ["data: [DONE]", ""]
            reasons.append(json.loads(events[-3].removeprefix("data: "))["choices"][0]["finish_reason"])
    # The one running may have reached its 250 tokens on a slow machine; the three waiting cannot have.
    assert sorted(reasons)[:3] == ["abort"] * 3 and set(reasons) <= {"abort", "length"}, reasons
    stderr = "".join(process.stderr_lines)  # type: ignore[attr-defined]
    assert "Traceback" not in stderr and "Exception in ASGI" not in stderr, stderr


def _refused(url: str) -> bool:
    """Whether the server no longer accepts connections."""
    try:
        httpx.get(f"{url}/health", timeout=1)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def test_no_connection_is_taken_before_the_model_is_loaded(install_plugin, tmp_path):
    # The socket listened from the start: a connection made during the load was taken (a TCP readiness probe said
    # ready), its request hung until the load ended, or was reset when the load failed.
    loading = tmp_path / "loading"
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    process = serving_slowly(install_plugin, loading, 3, "--port", str(port))
    try:
        assert wait_until(lambda: loading.exists() or process.poll() is not None, TIMEOUT)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT).close()
        url, lines = served_url(process, TIMEOUT)
        assert url == f"http://127.0.0.1:{port}", "".join(lines)
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
    finally:
        process.kill()
        process.communicate(timeout=TIMEOUT)


def test_a_loopback_address_named_otherwise_still_refuses_other_sites_names(tiny_opt):
    # Whether a Host is checked was decided from the name typed: --host 127.1 (or this machine's name, resolving
    # to 127.0.0.1) listened on loopback and answered a DNS-rebinding page's requests.
    with serving("--model", str(tiny_opt), "--host", "127.1") as (process, url):
        port = url.rsplit(":", 1)[1]
        assert url == f"http://127.0.0.1:{port}"
        rebound = httpx.get(f"{url}/v1/models", headers={"Host": f"attacker.example:{port}"}, timeout=TIMEOUT)
        assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "invalid_host"
        for name in ("127.1", "127.0.0.1", "localhost"):
            assert httpx.get(f"{url}/health", headers={"Host": f"{name}:{port}"}, timeout=TIMEOUT).status_code == 200


def test_a_busy_port_is_one_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "pluginhost", "serve", "--port", str(port), "--no-plugins"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    assert result.returncode == 2
    assert f"Cannot listen on 127.0.0.1:{port}" in result.stderr and "--port" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_port_another_server_has_bound_while_it_loads_is_taken():
    # Bound with SO_REUSEADDR and not yet listening, the port held against nobody else binding so: a second
    # server loaded its whole model, then one of the two (maybe the first) failed to listen.
    from pluginhost.errors import ConfigError
    from pluginhost.server.run import bind, listen

    first = bind("127.0.0.1", 0)
    port = first.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match=rf"Cannot listen on 127.0.0.1:{port}: Address already in use"):
            bind("127.0.0.1", port).close()
        listen(first)
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT):
            first.accept()[0].close()  # the server's end closes first: its port has a connection in TIME_WAIT
    finally:
        first.close()
    again = bind("127.0.0.1", port)  # a server restarted at once gets its port back
    listen(again)
    again.close()


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_out_of_range_is_one_clear_error(port):
    result = subprocess.run(
        [sys.executable, "-m", "pluginhost", "serve", "--port", port, "--no-plugins"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"Cannot listen on 127.0.0.1:{port}: a port is a number from 0 to 65535" in result.stderr


def test_served_name_and_api_key(tiny_opt):
    # A key read from a secret file ends with a newline: it was kept, and no client could send it (401 for all).
    with serving("--model", str(tiny_opt), env={"PLUGINHOST_API_KEY": "k1\n"}) as (process, url):
        assert httpx.get(f"{url}/v1/models", timeout=TIMEOUT).status_code == 401
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k1"}, timeout=TIMEOUT).json()
        assert [m["id"] for m in models["data"]] == [tiny_opt.name]  # the directory's name
        process.send_signal(signal.SIGTERM)
        assert process.wait(TIMEOUT) == 0
    # A proxy on this machine passing its own name (--allowed-host): served, and still behind the key.
    named = ("--served-model-name", "tiny", "--api-key", "k2", "--allowed-host", "llm.internal")
    with serving(str(tiny_opt), *named) as (process, url):  # the model as vLLM's `vllm serve MODEL` takes it
        answer = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": [2, 5, 9], "max_tokens": 3},
            headers={"Authorization": "Bearer k2", "Host": "llm.internal"},
            timeout=TIMEOUT,
        )
        assert answer.status_code == 200 and json.loads(answer.text)["usage"]["completion_tokens"] >= 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(TIMEOUT) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
        (["--dtype", "float8"], "--dtype"),
        (["--api-key", ""], "--api-key is empty (an unset shell variable?), which would serve without a key"),
        # A secret not filled in: it served with no key, saying nothing.
        ({"PLUGINHOST_API_KEY": " "}, "$PLUGINHOST_API_KEY is empty (an unset shell variable?), which would serve"),
        (["--shutdown-timeout", "nan"], "--shutdown-timeout must be a number of seconds >= 0, got nan"),
        (["--shutdown-timeout", "-5"], "--shutdown-timeout must be a number of seconds >= 0, got -5"),
        (["--max-model-len", "100000000"], "error: --max-model-len 100000000 is more than the model's 256 positions"),
        (["/models/a", "--model", "/models/b"], "serve got two models, '/models/a' and --model '/models/b': give one"),
    ],
)
def test_bad_settings_exit_2_before_serving(args, message):
    env = {**os.environ, **args} if isinstance(args, dict) else None  # settings from the environment
    result = subprocess.run(
        [sys.executable, "-m", "pluginhost", "serve", "--port", "0", "--no-plugins", *([] if env else args)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr
