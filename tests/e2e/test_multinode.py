"""Two "nodes" on this machine over loopback: node 1 runs only worker rank 1, node 0 the API
server, tokenizer, scheduler and rank 0; tensor parallelism spans both (gloo over TCP). The
plan sockets admit only nodes holding the cluster secret (CURVE), on the address named."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile

import httpx
import zmq

from deepinfer import LLM, SamplingParams
from scripts.server_process import ServerProcess, free_ports
from scripts.tiny_models import save_tiny_model


def test_two_nodes_give_the_one_node_text(tmp_path):
    model = save_tiny_model(tmp_path / "tiny", "llama")
    prompt = [5, 17, 923, 4041, 88, 1200, 7, 300]
    with LLM(str(model)) as llm:
        ref = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0,
                                                    ignore_eos=True))[0]
    port = free_ports(3)  # the rendezvous, then rank 0's and rank 1's plans
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2",
             "--dist-init-addr", f"127.0.0.1:{port}"]
    secret = {"DEEPINFER_CLUSTER_SECRET": "multinode-test-secret"}
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **secret)
    node1 = subprocess.Popen(
        [sys.executable, "-m", "deepinfer", "serve", "--model", str(model), *flags,
         "--node-rank", "1"], cwd=tempfile.gettempdir(), env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        node0 = ServerProcess(model, *flags, "--node-rank", "0", env=secret)
        # Strangers connect to both ranks' plan sockets (a PUSH deals plans round-robin: one
        # such connection had taken plans, prompt tokens included, away from a rank).
        ctx = zmq.Context()
        strangers = []
        for plan_port in (port + 1, port + 2):
            sock = ctx.socket(zmq.PULL)
            sock.connect(f"tcp://127.0.0.1:{plan_port}")
            strangers.append(sock)
        try:
            for _ in range(3):
                r = httpx.post(f"{node0.base_url}/v1/completions", timeout=60, json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == ref.text
            assert not any(sock.poll(100) for sock in strangers)
            # Bound on the address --dist-init-addr names, not on every interface.
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.2", port + 1)) != 0
        finally:
            ctx.destroy(linger=0)
            node0.stop()
        assert node1.wait(timeout=60) == 0  # node 0's scheduler told its rank to exit
    finally:
        if node1.poll() is None:
            node1.kill()
