"""End to end on a real one-node cluster: the chart's operator (from the built image) turns the example
InferenceService into real pods that load the default model, pass their probes and serve a chat through the router
Service, prefill -> NIXL -> decode across pods, with the same greedy answer as a monolithic engine. Then the decode pod
is deleted (replaced, traffic recovers), decode is scaled to 2 (the router sees both), and deleting the
InferenceService garbage-collects everything it owned.

The one deviation from crds/examples/smollm2-pd.yaml: its cpu requests (1 per pod) are lowered, since the test node
has only the cores of the machine running it (2 in CI), and 3 runtime pods + router + operator must fit.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
import yaml
from openai import OpenAI

from tests.cluster.node import NodeCluster
from tests.operator.kubeenv import REPO

# The session fixture (image import, node start) counts towards the timeout too.
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(5400)]

EXAMPLE = REPO / "crds" / "examples" / "smollm2-pd.yaml"
CHART = REPO / "charts" / "pdserve"
NS = "default"
ISVC = "smollm2"
# Longer than the example's pdThreshold (256 tokens), so the router disaggregates: prefill pod, NIXL, decode pod.
LONG_PROMPT = ("Here are some notes about rivers. " + " ".join(
    f"River number {i} flows through a valley, feeds farms and towns, and ends in the sea." for i in range(24))
    + " Summarise the notes in one sentence.")
MAX_TOKENS = 20
POD_READY_S = 1200  # image start + torch import + model load on a shared 2-core machine


@pytest.fixture(scope="module")
def monolithic_answer() -> str:
    from pdserve.runtime import LLM, SamplingParams

    llm = LLM()  # the example's dtype: auto
    out = llm.chat([[{"role": "user", "content": LONG_PROMPT}]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    llm.shutdown()
    return out[0].outputs[0].text


def example_manifest() -> str:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["runtime"]["resources"]["requests"]["cpu"] = "400m"  # see the module docstring
    return yaml.safe_dump(doc)


def ready_pods(c: NodeCluster, role: str) -> list[dict]:
    pods = c.get(f"/api/v1/namespaces/{NS}/pods?labelSelector=app.kubernetes.io/instance={ISVC},"
                 f"pdserve.dev/role={role}")["items"]
    return [p for p in pods if p["metadata"].get("deletionTimestamp") is None and any(
        cond["type"] == "Ready" and cond["status"] == "True" for cond in p["status"].get("conditions", []))]


def wait_pods(c: NodeCluster, role: str, n: int, timeout: float = POD_READY_S) -> list[dict]:
    return c.wait_for(lambda: (pods := ready_pods(c, role)) and len(pods) == n and pods, timeout,
                      f"{n} ready {role} pod(s)", interval=2)


def router_metrics(c: NodeCluster) -> str:
    pod = wait_pods(c, "router", 1, 300)[0]
    return httpx.get(f"http://{pod['status']['podIP']}:8080/metrics", timeout=10).text


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def chat(client: OpenAI) -> str:
    r = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=MAX_TOKENS,
                                       messages=[{"role": "user", "content": LONG_PROMPT}])
    return r.choices[0].message.content


def test_inference_service_on_a_real_node(node_cluster: NodeCluster, pdserve_image: str, monolithic_answer: str):
    c = node_cluster
    t0 = time.monotonic()
    c.helm("install", "pdserve", str(CHART), "--namespace", "pdserve-system", "--create-namespace",
           "--wait", "--timeout", "15m", timeout=1000)
    c.kubectl("apply", "-n", NS, "-f", "-", input=example_manifest())
    for role in ("prefill", "decode", "router"):
        wait_pods(c, role, 1)
    print(f"\npods ready {time.monotonic() - t0:.0f}s after helm install")

    # The router Service, from the node through its ClusterIP (kube-proxy's iptables rules).
    svc = c.get(f"/api/v1/namespaces/{NS}/services/{ISVC}")
    url = f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}/v1"
    client = OpenAI(base_url=url, api_key="unused", timeout=300, max_retries=0)
    c.wait_for(lambda: metric(router_metrics(c), "pdserve_router_endpoints", role="decode", state="healthy") >= 1
               and metric(router_metrics(c), "pdserve_router_endpoints", role="prefill", state="healthy") >= 1,
               300, "router discovers prefill and decode", interval=2)
    assert chat(client) == monolithic_answer
    text = router_metrics(c)
    assert metric(text, "pdserve_router_pd_decisions_total", decision="disaggregated") >= 1, text
    assert metric(text, "pdserve_router_routing_decisions_total", role="prefill") >= 1, text

    # Delete the decode pod: its Deployment replaces it and traffic recovers.
    old = wait_pods(c, "decode", 1)[0]["metadata"]["name"]
    c.kubectl("delete", "pod", "-n", NS, old, "--wait=false")
    new = c.wait_for(lambda: [p for p in ready_pods(c, "decode") if p["metadata"]["name"] != old], POD_READY_S,
                     "a replacement decode pod", interval=2)
    assert len(new) == 1

    def recovered() -> bool:
        try:
            return chat(client) == monolithic_answer
        except Exception:  # noqa: BLE001 - the router may still be dropping the old pod
            return False
    c.wait_for(recovered, 300, "traffic through the replacement decode pod", interval=3)

    # Scale decode to 2: the second pod joins the router.
    c.kubectl("scale", "-n", NS, f"pdis/{ISVC}", "--replicas", "2")
    wait_pods(c, "decode", 2)
    c.wait_for(lambda: metric(router_metrics(c), "pdserve_router_endpoints", role="decode", state="healthy") == 2,
               300, "router sees 2 decode pods", interval=2)
    assert chat(client) == monolithic_answer

    # Delete the InferenceService: every object it owned is garbage-collected.
    c.kubectl("delete", "-n", NS, f"pdis/{ISVC}", "--wait=true", timeout=300)
    selector = f"app.kubernetes.io/instance={ISVC}"
    for kind in ("pods", "services", "configmaps", "secrets", "serviceaccounts"):
        c.wait_for(lambda kind=kind: not c.get(f"/api/v1/namespaces/{NS}/{kind}?labelSelector={selector}")["items"],
                   300, f"{kind} of {ISVC} garbage-collected", interval=2)
    for kind in ("deployments",):
        c.wait_for(lambda kind=kind: not c.get(f"/apis/apps/v1/namespaces/{NS}/{kind}?labelSelector={selector}")
                   ["items"], 300, f"{kind} of {ISVC} garbage-collected", interval=2)
    c.helm("uninstall", "pdserve", "--namespace", "pdserve-system", "--wait", "--timeout", "5m")
    print(f"cluster e2e took {time.monotonic() - t0:.0f}s after node start")
