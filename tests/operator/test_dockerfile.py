"""The image recipe, checked statically on its parsed instructions (tests/support/dockerfile.py): multi-stage, numeric
non-root USER (the UID the operator's pods run as), no secrets in ENV/ARG or copied files, no remote ADD, no compilers
or pip caches in the final stage, the writable paths and ports the operator's pods expect.

The image itself is built (scripts/build-image.sh) and run as pods on a real node by tests/cluster/test_cluster_e2e.py
(`make test-cluster`; skipped where there is no built image); this file is what runs everywhere, in seconds.
"""

from __future__ import annotations

import re

import pytest

from pdserve.operator import names, pod
from tests.operator.kubeenv import REPO
from tests.support.dockerfile import Dockerfile, parse

SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSW(OR)?D|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL|AUTH)", re.I)
SECRET_VALUE = re.compile(r"(hf_[A-Za-z0-9]{20,}|ghp_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16}|"
                          r"-----BEGIN [A-Z ]*PRIVATE KEY)")
SECRET_FILE = re.compile(r"(^|/)(\.env|\.netrc|\.pypirc|\.npmrc|\.git-credentials|id_[a-z0-9]+|kubeconfig|"
                         r"\.docker|credentials[^/]*|[^/]*\.(pem|key|p12|pfx))/?$", re.I)
BUILD_TOOLS = ("build-essential", "gcc", "g++", "make ", "pip install", "git ", "curl ", "wget ")
# What the operator's pods expect of the image (operator/pod.py, operator/names.py, the chart's operator liveness).
PORTS = {names.RUNTIME_PORT, names.ROUTER_PORT, names.NIXL_PORT, names.KV_EVENTS_PORT, names.KV_EVENTS_REPLAY_PORT,
         8081}


def image_problems(df: Dockerfile) -> list[str]:
    """Everything wrong with a Dockerfile by this project's rules (empty for ours)."""
    bad: list[str] = []
    if len(df.stages) < 2:
        bad.append("multi-stage build expected")
        return bad
    final = df.stages[-1]
    users = final.of("USER")
    if not users or not re.fullmatch(r"([0-9]+):([0-9]+)", users[-1].args):
        bad.append("the final stage must end as a numeric USER uid:gid (kubelet's runAsNonRoot needs a number)")
    elif int(users[-1].args.split(":")[0]) == 0 or int(users[-1].args.split(":")[1]) == 0:
        bad.append(f"USER {users[-1].args} is root")
    elif int(users[-1].args.split(":")[0]) != pod.UID:
        bad.append(f"USER {users[-1].args} is not the UID the operator's pods run as ({pod.UID})")
    elif not any(f":x:{pod.UID}:{pod.UID}:" in r.args for r in final.of("RUN")):
        bad.append("no passwd entry for the image user (kopf and getpass.getuser() look it up)")
    for i in df.all():
        if i.cmd == "ADD":
            bad.append(f"line {i.line}: ADD (remote fetches and auto-extraction); use COPY")
        if i.cmd in ("ENV", "ARG", "LABEL"):
            for k, v in i.pairs().items():
                if SECRET_NAME.search(k) or (v and SECRET_VALUE.search(v)):
                    bad.append(f"line {i.line}: secret-like {i.cmd} {k} (baked into the image's history)")
        if i.cmd == "COPY":
            for src in i.args.split()[:-1]:
                if SECRET_FILE.search(src):
                    bad.append(f"line {i.line}: COPY of a credentials file {src}")
        if i.cmd == "RUN" and SECRET_VALUE.search(i.args):
            bad.append(f"line {i.line}: a secret in a RUN command")
        if i.cmd == "RUN" and re.search(r"\b(curl|wget)\b[^|&;]*\|\s*(ba)?sh\b", i.args):
            bad.append(f"line {i.line}: a script piped from the network into a shell")
        if i.cmd == "RUN" and "pip install" in i.args and not (
                i.flags.get("mount", "").startswith("type=cache,target=/root/.cache/pip")
                or all("--no-cache-dir" in part for part in i.args.split("pip install")[1:])):
            bad.append(f"line {i.line}: pip cache left in a layer (use --no-cache-dir or a cache mount)")
        if i.cmd == "RUN" and "apt-get install" in i.args and not (
                "--no-install-recommends" in i.args and "rm -rf /var/lib/apt/lists" in i.args):
            bad.append(f"line {i.line}: apt-get install without --no-install-recommends and list cleanup")
    for r in final.of("RUN"):
        bad += [f"line {r.line}: {tool.strip()!r} in the final stage" for tool in BUILD_TOOLS if tool in r.args]
    copies = final.of("COPY")
    if [(c.flags.get("from"), c.args) for c in copies] != [("builder", "/opt/pdserve /opt/pdserve")]:
        bad.append(f"the final stage copies only the builder's venv, got {[(c.flags, c.args) for c in copies]}")
    return bad


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse((REPO / "Dockerfile").read_text())


def test_dockerfile_has_no_problems(dockerfile):
    assert image_problems(dockerfile) == []


def test_stages_share_the_base_image(dockerfile):
    # GPU images swap the base with --build-arg BASE_IMAGE; the venv's interpreter path must match in both stages
    assert dockerfile.global_args["BASE_IMAGE"].startswith("python:3.")
    assert [(s.base, s.name) for s in dockerfile.stages] == [("${BASE_IMAGE}", "builder"), ("${BASE_IMAGE}", "final")]


def test_final_stage_runtime_contract(dockerfile):
    final = dockerfile.stages[-1]
    assert [e.exec_form for e in final.of("ENTRYPOINT")] == [["pdserve"]]
    assert all(c.exec_form is not None for c in final.of("CMD"))
    env = {k: v for e in final.of("ENV") for k, v in e.pairs().items()}
    # read-only root filesystem: HOME and every cache under /cache, no .pyc writes
    assert env["HOME"] == env["XDG_CACHE_HOME"] == "/cache" and env["PYTHONDONTWRITEBYTECODE"] == "1"
    for var in ("PDSERVE_CACHE_DIR", "HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert env[var].startswith("/cache/"), var
    assert env["PATH"].startswith("/opt/pdserve/bin:")
    volumes = [v for i in final.of("VOLUME") for v in (i.exec_form or i.args.split())]
    assert set(volumes) == {m["mountPath"] for m in pod.writable_volumes()[1]}   # what the pods mount as emptyDirs
    assert [w.args for w in final.of("WORKDIR")][-1] == "/cache"
    exposed = {int(p.split("/")[0]) for e in final.of("EXPOSE") for p in e.args.split()}
    assert exposed == PORTS


def test_dockerfile_copies_every_package_folder(dockerfile):
    import tomllib

    dirs = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    top = {d.split("/")[0] for d in dirs}
    copied = {c.args.split()[0].rstrip("/") for c in dockerfile.stages[0].of("COPY")}
    assert top <= copied, f"not copied into the image: {sorted(top - copied)}"


def test_dockerignore_keeps_the_context_small():
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", "tests"} <= ignored


# ---- the checker itself: a parser quirk or a too-lenient rule would let the real file pass vacuously ----

BAD = """\
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE} AS builder
# a comment inside nothing
ENV HF_TOKEN=hf_abcdefghijklmnopqrstuvwx \\
    # a comment line inside a continuation
    OTHER=1
ADD https://example.com/x.tar.gz /x
COPY .env id_rsa ./
RUN pip install torch
RUN curl -s https://get.example.com | sh
FROM ${BASE_IMAGE} AS final
RUN apt-get install -y gcc
COPY --from=builder /opt/pdserve /opt/pdserve
USER root
"""


def test_parser_reads_flags_continuations_and_exec_form():
    df = parse(BAD + 'ENTRYPOINT ["pdserve", "serve"]\n')
    env = df.stages[0].of("ENV")[0]
    assert env.pairs() == {"HF_TOKEN": "hf_abcdefghijklmnopqrstuvwx", "OTHER": "1"} and env.line == 4
    assert df.stages[1].of("COPY")[0].flags == {"from": "builder"}
    assert df.stages[1].of("ENTRYPOINT")[0].exec_form == ["pdserve", "serve"]
    assert df.global_args == {"BASE_IMAGE": "python:3.12-slim"}
    with pytest.raises(ValueError, match="unknown instruction"):
        parse("FROM x\nRUNN true\n")


def test_checker_flags_each_problem():
    problems = "\n".join(image_problems(parse(BAD)))
    for expected in ("numeric USER", "secret-like ENV HF_TOKEN", "ADD (remote", "credentials file .env",
                     "credentials file id_rsa", "pip cache", "piped from the network", "apt-get install without",
                     "'gcc' in the final stage"):
        assert expected in problems, expected
    for user, why in (("0:0", "is root"), ("10001:0", "is root"), ("1000:1000", "not the UID"),
                      ("10001:10001", "no passwd entry"), ("pdserve", "numeric USER")):
        assert why in "\n".join(image_problems(parse(f"FROM a AS b\nFROM a\nUSER {user}\n"))), user
