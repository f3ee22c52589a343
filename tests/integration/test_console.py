"""The web console in a real headless browser (Debian's chromium and chromium-driver, through selenium) against
a real cluster with users: a replication pair and two more nodes (three live nodes). It logs in, sees the
three nodes, reads the queues, purges a queue, moves dead letters back, follows a message's audit trail and
watches the pair's backup take over when its primary is killed. Screenshots of every page are written to the
test's folder; ``TRIDENTMQ_CONSOLE_SHOTS=DIR`` also copies them to DIR (how docs/console/*.png are made)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import stomp
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from tests.conftest import CoreProcess, _started, basic_auth, start_core, start_gateway
from tests.integration.cluster_nodes import CLUSTER_PASSWORD, CLUSTER_USER, cluster_env, wait_until
from tests.integration.mqtt_clients import Paho

from tridentmq_core.security import hash_password
from tridentmq_shared.link.client import Delivery, LinkClient
from tridentmq_shared.link.failover import ReconnectPolicy
from tridentmq_shared.link.ops import NackMode
from tridentmq_shared.message import M_PROPS, new_message

pytestmark = pytest.mark.integration

ADMIN, ADMIN_PASSWORD = "admin", "console-admin-5d1"
APP, APP_PASSWORD = "app", "console-app-0b7"
CONFIG = f"""
[cluster]
user = "{CLUSTER_USER}"
password = "{CLUSTER_PASSWORD}"

[[users]]
name = "{ADMIN}"
password = "{hash_password(ADMIN_PASSWORD, salt=b"console-test", iterations=10_000)}"
roles = ["admin"]

[[users]]
name = "{APP}"
password = "{APP_PASSWORD}"
roles = ["app"]

[[permissions]]
match = "#"
permission = "manage"
roles = ["admin"]

""" + "".join(
    f"""
[[permissions]]
match = "#"
permission = "{permission}"
roles = ["app"]
"""
    for permission in (
        "send",
        "consume",
        "browse",
        "createAddress",
        "createDurableQueue",
        "deleteDurableQueue",
        "createNonDurableQueue",
        "deleteNonDurableQueue",
    )  # an MQTT gateway's sessions need them all
)
ADMIN_AUTH = basic_auth(ADMIN, ADMIN_PASSWORD)
WAIT = 30.0


@dataclass
class Cluster:
    primary: CoreProcess  # of the pair "a"; the browser talks to node b
    backup: CoreProcess
    b: CoreProcess
    c: CoreProcess


def api(node: CoreProcess, path: str) -> Any:
    request = urllib.request.Request(node.management_url + path, headers=ADMIN_AUTH)
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def status(node: CoreProcess) -> dict[str, Any]:
    try:
        return dict(api(node, "/api/status"))
    except (urllib.error.URLError, OSError):
        return {}


def node(tmp_path: Path, name: str, connectors: list[CoreProcess], **settings: str) -> CoreProcess:
    env = cluster_env(connectors)
    env.update({f"TRIDENTMQ_{k.upper()}": v for k, v in settings.items()})
    return start_core(tmp_path, name, config=CONFIG, **env)


def members(node: CoreProcess) -> set[str]:
    cluster = status(node).get("cluster") or {}
    return {m["name"] for m in cluster.get("members", [])}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp_path = tmp_path_factory.mktemp("console")
    ha = {
        "core_ha_policy": "replication",
        "core_ha_group_name": "a",
        "core_ha_activate_without_quorum": "true",
        "core_ha_allow_failback": "false",
        "core_audit_message_events": "all",
    }
    primary = node(tmp_path, "a-primary", [], **ha)
    b = node(tmp_path, "b", [primary], core_audit_message_events="all")
    c = node(tmp_path, "c", [primary], core_audit_message_events="all")
    # The backup knows the other nodes: when it takes over, it joins them itself.
    backup = node(tmp_path, "a-backup", [primary, b, c], core_ha_role="backup", **ha)
    nodes = [primary, backup, b, c]
    for n in nodes:  # they outlive each test (stopped below), unlike what a test starts
        _started.remove(n.process)
    try:
        wait_until(lambda: (status(backup).get("ha") or {}).get("in_sync") is True, WAIT, "the backup in sync")
        wait_until(lambda: all(members(n) == {"a-primary", "b", "c"} for n in (primary, b, c)), WAIT, "3 members")
        yield Cluster(primary, backup, b, c)
    finally:
        for n in nodes:
            if n.process.poll() is None:
                n.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    driver = shutil.which("chromedriver")
    chromium = shutil.which("chromium")
    if driver is None or chromium is None:
        pytest.skip("needs Debian's chromium and chromium-driver (installed by .ci/run)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(arg)
    chrome = webdriver.Chrome(options=options, service=Service(driver))
    try:
        yield chrome
    finally:
        chrome.quit()


def shot(browser: webdriver.Chrome, tmp_path: Path, name: str) -> None:
    """A screenshot of the whole page (the viewport grows to the page's height for it)."""
    height = int(browser.execute_script("return document.documentElement.scrollHeight"))
    metrics = {"width": 1400, "height": max(700, min(height, 4000)), "deviceScaleFactor": 1, "mobile": False}
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    path = tmp_path / f"{name}.png"
    try:
        assert browser.save_screenshot(str(path))
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    out = os.environ.get("TRIDENTMQ_CONSOLE_SHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / path.name)


def wait_for(browser: webdriver.Chrome, what: str, predicate: Callable[[webdriver.Chrome], Any]) -> Any:
    def check(driver: webdriver.Chrome) -> Any:
        try:
            return predicate(driver)
        except (StaleElementReferenceException, WebDriverException):
            return False  # the page was redrawn between finding and reading an element

    try:
        return WebDriverWait(browser, WAIT, poll_frequency=0.1).until(check)
    except Exception as exc:
        page = browser.find_element(By.TAG_NAME, "body").text[:3000]
        raise AssertionError(f"timed out waiting for {what}; the page says: {page}") from exc


def text(browser: webdriver.Chrome, selector: str) -> str:
    """The text of ``selector``, read again when the page redrew it between finding and reading (it refreshes
    itself every 2 s)."""
    return str(
        wait_for(browser, f"the text of {selector}", lambda d: (d.find_element(By.CSS_SELECTOR, selector).text,))[0]
    )


def click(browser: webdriver.Chrome, by: str, value: str) -> None:
    """Click an element of a part of the page that redraws itself (found again if it was redrawn)."""

    def clicked(driver: webdriver.Chrome) -> bool:
        driver.find_element(by, value).click()
        return True

    wait_for(browser, f"a click on {value}", clicked)


def open_page(browser: webdriver.Chrome, cluster: Cluster, page: str) -> None:
    browser.get("about:blank")  # a new document even when only the fragment differs
    browser.get(f"{cluster.b.management_url}/console/#/{page}")


def log_in(browser: webdriver.Chrome, cluster: Cluster, page: str = "cluster") -> None:
    """A fresh login (the tab's session storage keeps the credentials of the previous test), then ``page``."""
    open_page(browser, cluster, page)
    browser.execute_script("sessionStorage.clear()")
    open_page(browser, cluster, page)
    wait_for(browser, "the login form", lambda d: d.find_element(By.ID, "login-user").is_displayed())
    browser.find_element(By.ID, "login-user").send_keys(ADMIN)
    browser.find_element(By.ID, "login-password").send_keys(ADMIN_PASSWORD)
    browser.find_element(By.ID, "login-submit").click()
    wait_for(browser, "the console", lambda d: d.find_element(By.ID, "top").is_displayed())


def app_client(node: CoreProcess) -> LinkClient:
    return LinkClient(
        "127.0.0.1", node.link_port, user=APP, password=APP_PASSWORD, reconnect=ReconnectPolicy(attempts=0)
    )


async def publish(node: CoreProcess, address: str, count: int, *, create: bool = False) -> None:
    """``count`` durable messages to ``address``; with ``create``, into a queue made first by hand (an
    auto-created one is deleted once unused: a purged one could be gone before the page shows it empty)."""
    async with app_client(node) as client:
        if create:
            await client.create_queue(address)
        for n in range(count):
            await client.publish(new_message(address, f"{address} {n}".encode(), durable=True))


def test_a_wrong_password_is_refused_and_the_page_holds_no_credentials(
    browser: webdriver.Chrome, cluster: Cluster, tmp_path: Path
) -> None:
    open_page(browser, cluster, "cluster")
    wait_for(browser, "the login form", lambda d: d.find_element(By.ID, "login-user").is_displayed())
    browser.find_element(By.ID, "login-user").send_keys(ADMIN)
    browser.find_element(By.ID, "login-password").send_keys("wrong")
    browser.find_element(By.ID, "login-submit").click()
    wait_for(browser, "the refusal", lambda d: "wrong password" in text(d, "#login-error"))
    assert "wrong" not in browser.current_url
    assert ADMIN not in browser.current_url
    shot(browser, tmp_path, "login")


def test_the_cluster_page_shows_three_nodes_and_the_pair(
    browser: webdriver.Chrome, cluster: Cluster, tmp_path: Path
) -> None:
    log_in(browser, cluster)
    wait_for(browser, "three node cards", lambda d: len(d.find_elements(By.CSS_SELECTOR, "#topology .node")) == 3)
    wait_for(
        browser,
        "the three nodes",
        lambda d: (
            {e.get_attribute("data-name") for e in d.find_elements(By.CSS_SELECTOR, "#topology .node")}
            == {"a-primary", "b", "c"}
        ),
    )
    pair = text(browser, '#topology .node[data-name="a-primary"]')
    assert "pair a" in pair, pair
    assert "in sync" in pair, pair
    wait_for(browser, "six cluster connections up", lambda d: text(d, "#cluster-connections tbody").count(" up") == 6)
    shot(browser, tmp_path, "cluster")


def test_the_queues_page_sorts_and_searches_the_queues_of_every_node(
    browser: webdriver.Chrome, cluster: Cluster, tmp_path: Path
) -> None:
    asyncio.run(publish(cluster.c, "orders.eu", 5))
    asyncio.run(publish(cluster.b, "orders.us", 2))
    log_in(browser, cluster, "queues")

    def rows(driver: webdriver.Chrome) -> list[list[str]]:
        return [
            [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
            for tr in driver.find_elements(By.CSS_SELECTOR, "#queues tbody tr")
        ]

    wait_for(
        browser,
        "both queues",
        lambda d: (
            {(r[0], r[1], r[4]) for r in rows(d) if r[0].startswith("orders")}
            == {("orders.eu", "c", "5"), ("orders.us", "b", "2")}
        ),
    )
    browser.find_element(By.CSS_SELECTOR, '#queues th[data-key="depth"]').click()  # numbers: largest first
    wait_for(browser, "the deepest first", lambda d: rows(d)[0][0] == "orders.eu")
    browser.find_element(By.ID, "queue-search").send_keys("US")
    wait_for(browser, "one queue found", lambda d: [r[0] for r in rows(d)] == ["orders.us"])
    browser.find_element(By.ID, "queue-search").clear()
    browser.find_element(By.ID, "queue-search").send_keys("orders")
    wait_for(browser, "two queues found", lambda d: len(rows(d)) == 2)
    shot(browser, tmp_path, "queues")
    click(browser, By.LINK_TEXT, "orders.eu")
    wait_for(browser, "the queue page", lambda d: text(d, '#queue-details dd[data-field="depth"]') == "5")
    assert text(browser, '#queue-details dd[data-field="node"]') == "c"
    shot(browser, tmp_path, "queue")


def test_the_gateways_page_lists_clients_per_protocol_and_closes_one(
    browser: webdriver.Chrome, cluster: Cluster, tmp_path: Path
) -> None:
    gateway = start_gateway(
        tmp_path,
        cluster.b,
        TRIDENTMQ_STOMP_NODE_NAME="stomp-1",  # its own links: as "app"
        TRIDENTMQ_STOMP_CORE_USER=APP,
        TRIDENTMQ_STOMP_CORE_PASSWORD=APP_PASSWORD,
    )
    try:
        connection = stomp.Connection12([("127.0.0.1", gateway.port)])
        connection.connect(username=APP, passcode=APP_PASSWORD, wait=True)
        try:
            log_in(browser, cluster, "gateways")
            wait_for(browser, "the STOMP client", lambda d: "stomp 127.0.0.1:" in text(d, "#clients-stomp tbody"))
            assert APP in text(browser, "#clients-stomp tbody")
            wait_for(
                browser, "the gateway's own link", lambda d: "stomp-1 readiness" in text(d, "#clients-gateway tbody")
            )
            assert "cluster:" in text(browser, "#clients-cluster tbody")
            shot(browser, tmp_path, "gateways")
            click_and_confirm(browser, By.CSS_SELECTOR, "#clients-stomp tbody button")  # Close
            wait_for(browser, "the answer", lambda d: text(d, ".toast") == "close: closed 1")
            wait_for(browser, "no STOMP client", lambda d: "nothing to show" in text(d, "#clients-stomp tbody"))
            wait_until(lambda: not connection.is_connected(), WAIT, "the STOMP client cut off")
        finally:
            if connection.is_connected():
                connection.disconnect()
    finally:
        gateway.stop()


def test_the_mqtt_page_lists_sessions_and_clears_a_retained_message(
    browser: webdriver.Chrome, cluster: Cluster, tmp_path: Path
) -> None:
    gateway = start_gateway(
        tmp_path,
        cluster.b,
        "mqtt",
        TRIDENTMQ_MQTT_NODE_NAME="mqtt-1",
        TRIDENTMQ_MQTT_CORE_USER=APP,
        TRIDENTMQ_MQTT_CORE_PASSWORD=APP_PASSWORD,
    )
    device = Paho(gateway.port, "console-sensor-7", clean=False, username=APP, password=APP_PASSWORD)
    try:
        device.connect(expiry=3600)
        device.subscribe("console/sensors/+/cmd", qos=1)
        device.publish("console/sensors/7/state", b"online", qos=1, retain=True)
        log_in(browser, cluster, "mqtt")
        wait_for(browser, "the session", lambda d: "console-sensor-7" in text(d, "#mqtt-sessions tbody"))
        assert "console/sensors/+/cmd" in text(browser, "#mqtt-sessions tbody")
        wait_for(
            browser, "the retained message", lambda d: "console/sensors/7/state" in text(d, "#mqtt-retained tbody")
        )
        assert "online" in text(browser, "#mqtt-retained tbody")
        shot(browser, tmp_path, "mqtt")
        click_and_confirm(browser, By.CSS_SELECTOR, "#mqtt-retained tbody button")  # Clear
        wait_for(
            browser,
            "the retained message gone",
            lambda d: "console/sensors/7/state" not in text(d, "#mqtt-retained tbody"),
        )
        # A new subscriber gets no retained message for it any more: cleared in the core, not only on the page.
        late = Paho(gateway.port, "console-late", username=APP, password=APP_PASSWORD)
        late.connect()
        try:
            late.subscribe("console/sensors/7/state", qos=1)
            device.publish("console/sensors/7/state", b"live", qos=1)  # not retained: after the SUBACK
            assert [m.payload for m in late.receive(1)] == [b"live"]
        finally:
            late.disconnect()
    finally:
        device.disconnect()
        gateway.stop()


async def consume_one(node: CoreProcess, queue: str) -> Delivery:
    async with app_client(node) as client:
        consumer = await client.subscribe(queue, credit=1)
        delivery = await consumer.get(timeout=WAIT)
        assert delivery is not None
        consumer.ack(delivery)
        await client.create_queue(queue)  # a round trip: the ack was handled before its answer
        return delivery


def test_the_audit_page_follows_a_message_across_nodes(
    browser: webdriver.Chrome, cluster: Cluster, tmp_path: Path
) -> None:
    """Published on c, consumed on b: c moved it to b, so its history is on both nodes, under c's id."""
    asyncio.run(publish(cluster.c, "payments", 1))
    delivery = asyncio.run(consume_one(cluster.b, "payments"))
    origin = delivery.message[M_PROPS]["_TMQ_ORIG_MESSAGE_ID"]
    log_in(browser, cluster, f"audit/{origin}")

    def events(driver: webdriver.Chrome) -> list[tuple[str, str]]:
        return [
            (tr.find_elements(By.TAG_NAME, "td")[1].text, str(tr.get_attribute("data-event")))
            for tr in driver.find_elements(By.CSS_SELECTOR, "#audit-events tbody tr[data-event]")
        ]

    wait_for(
        browser,
        "the events on both nodes",
        lambda d: {("c", "msg.sent"), ("b", "msg.sent"), ("b", "msg.delivered"), ("b", "msg.acked")} <= set(events(d)),
    )
    seen = events(browser)
    assert seen[0] == ("c", "msg.sent")
    assert {("c", "msg.forwarded"), ("c", "msg.redistributed")} & set(seen), seen  # moved before or after it waited
    shot(browser, tmp_path, "audit")


async def consume(node: CoreProcess, queue: str, count: int) -> None:
    """Take and acknowledge ``count`` messages of ``queue``, each as it comes."""
    async with app_client(node) as client:
        consumer = await client.subscribe(queue, credit=count)
        for _ in range(count):
            delivery = await consumer.get(timeout=WAIT)
            assert delivery is not None
            consumer.ack(delivery)
        await client.create_queue(f"{queue}.done")  # a round trip: the acks were handled before its answer


def test_the_charts_page_draws_the_rates_and_the_latency(
    browser: webdriver.Chrome, cluster: Cluster, tmp_path: Path
) -> None:
    log_in(browser, cluster, "charts")
    wait_for(browser, "four charts", lambda d: len(d.find_elements(By.CSS_SELECTOR, ".chart canvas")) == 4)
    rates = browser.find_element(By.ID, "chart-rates")
    latency = browser.find_element(By.ID, "chart-latency")
    for batch in range(3):  # one batch per sample, for a line rather than a dot
        samples = int(rates.get_attribute("data-samples") or 0)
        asyncio.run(publish(cluster.b, "charts", 10, create=batch == 0))
        asyncio.run(consume(cluster.b, "charts", 10))
        wait_for(
            browser,
            "a sample after the batch",
            lambda d, seen=samples: int(rates.get_attribute("data-samples") or 0) > seen,
        )
    wait_for(browser, "a sample with the messages", lambda d: int(rates.get_attribute("data-routed") or 0) >= 30)
    wait_for(browser, "the acks timed", lambda d: int(latency.get_attribute("data-timed") or 0) >= 30)
    legend = latency.find_element(By.CSS_SELECTOR, ".u-legend").text
    assert "p50" in legend
    assert "p99" in legend
    wait_for(browser, "a few samples more", lambda d: int(rates.get_attribute("data-samples") or 0) >= 5)
    shot(browser, tmp_path, "charts")


def node_id(node: CoreProcess) -> str:
    return str(status(node)["node_id"])


def depth(node: CoreProcess, queue: str) -> int:
    return int(api(node, f"/api/queues/{queue}")["depth"])


def message_rows(browser: webdriver.Chrome) -> int:
    return len(browser.find_elements(By.CSS_SELECTOR, "#messages tbody tr td.body"))


def click_and_confirm(browser: webdriver.Chrome, by: str, value: str) -> str:
    """Click a button, accept the question it asks; what the console then says (its toast)."""
    click(browser, by, value)
    wait_for(browser, "the confirmation", lambda d: d.switch_to.alert).accept()
    return str(wait_for(browser, "the answer", lambda d: text(d, ".toast")))


def test_a_queue_is_purged_from_its_page(browser: webdriver.Chrome, cluster: Cluster, tmp_path: Path) -> None:
    asyncio.run(publish(cluster.c, "returns", 4, create=True))
    assert depth(cluster.c, "returns") == 4
    log_in(browser, cluster, f"queue/{node_id(cluster.c)}/returns")
    wait_for(
        browser, "four messages listed", lambda d: len(d.find_elements(By.CSS_SELECTOR, "#messages tbody tr")) == 4
    )
    assert "returns 0" in text(browser, "#messages tbody")  # the body preview
    said = click_and_confirm(browser, By.ID, "op-purge")
    assert said == "Purge: purged 4", said
    wait_for(browser, "the empty queue", lambda d: text(d, '#queue-details dd[data-field="depth"]') == "0")
    assert depth(cluster.c, "returns") == 0
    wait_for(browser, "no message listed", lambda d: "no messages" in text(d, "#messages tbody"))


async def dead_letter(node: CoreProcess, queue: str, count: int) -> None:
    """``count`` messages published to ``queue`` and rejected by their consumer: they go to the DLQ."""
    async with app_client(node) as client:
        await client.create_queue(queue)  # made by hand: it stays when its consumer leaves
        for n in range(count):
            await client.publish(new_message(queue, f"{queue} {n}".encode(), durable=True))
        consumer = await client.subscribe(queue, credit=count)
        for _ in range(count):
            delivery = await consumer.get(timeout=WAIT)
            assert delivery is not None
            consumer.nack(delivery, mode=NackMode.REJECT)
        await client.create_queue(queue)  # a round trip: the rejections were handled before its answer


def test_dead_letters_are_moved_back_to_their_queue(
    browser: webdriver.Chrome, cluster: Cluster, tmp_path: Path
) -> None:
    asyncio.run(dead_letter(cluster.b, "refunds", 3))
    wait_until(lambda: depth(cluster.b, "DLQ") == 3, WAIT, "three dead letters")
    assert depth(cluster.b, "refunds") == 0
    log_in(browser, cluster, f"queue/{node_id(cluster.b)}/DLQ")
    wait_for(
        browser, "the dead letters listed", lambda d: len(d.find_elements(By.CSS_SELECTOR, "#messages tbody tr")) == 3
    )
    assert "_AMQ_ORIG_QUEUE=refunds" in text(browser, "#messages tbody")
    shot(browser, tmp_path, "dlq")
    browser.find_element(By.ID, "op-move").click()  # no target: each goes back where it came from
    wait_for(browser, "the empty DLQ", lambda d: text(d, '#queue-details dd[data-field="depth"]') == "0")
    assert depth(cluster.b, "refunds") == 3
    assert "moved 3" in text(browser, ".toast")


def test_an_address_setting_is_changed_from_the_settings_page(
    browser: webdriver.Chrome, cluster: Cluster, tmp_path: Path
) -> None:
    log_in(browser, cluster, "settings")
    wait_for(browser, "the entries", lambda d: d.find_elements(By.CSS_SELECTOR, "#settings-entries table"))
    browser.find_element(By.ID, "settings-match").send_keys("refunds.#")
    browser.find_element(By.ID, "settings-values").send_keys('{"max_delivery_attempts": 3}')
    browser.find_element(By.CSS_SELECTOR, "#page form.panel button[type=submit]").click()
    wait_for(browser, "the new entry", lambda d: "refunds.#" in text(d, "#settings-entries"))
    browser.find_element(By.ID, "settings-address").send_keys("refunds.eu")
    browser.find_element(By.CSS_SELECTOR, "#page form.toolbar button[type=submit]").click()
    wait_for(browser, "what applies", lambda d: '"max_delivery_attempts": 3' in text(d, "#settings-resolved"))
    for node in (cluster.b, cluster.c):  # every node changed
        entries = api(node, "/api/address-settings")["entries"]
        assert {"match": "refunds.#", "max_delivery_attempts": 3} in entries, entries
    shot(browser, tmp_path, "settings")


def test_a_failover_appears_on_the_cluster_page(browser: webdriver.Chrome, cluster: Cluster, tmp_path: Path) -> None:
    """The pair's primary is killed and its backup takes over, with epoch 2."""
    log_in(browser, cluster)
    wait_for(browser, "the primary", lambda d: d.find_elements(By.CSS_SELECTOR, '.node[data-name="a-primary"]'))
    cluster.primary.process.send_signal(signal.SIGKILL)
    cluster.primary.process.wait(timeout=10)
    backup = '.node[data-name="a-backup"]'
    wait_for(browser, "the backup serving", lambda d: "backup, active" in text(d, backup))
    assert text(browser, f"{backup} .epoch") == "2"
    assert not browser.find_elements(By.CSS_SELECTOR, '.node[data-name="a-primary"]')
    shot(browser, tmp_path, "failover")


def test_a_page_whose_node_stops_answering_says_it_is_stale(
    browser: webdriver.Chrome, cluster: Cluster, tmp_path: Path
) -> None:
    """The last test of the module. The node that serves the console is frozen (SIGSTOP): it accepts connections
    and answers nothing. The page kept showing every node "ready" for as long as it stayed frozen; it now says
    that it is not being updated, and clears that once the node answers again."""
    log_in(browser, cluster)
    wait_for(browser, "node b ready", lambda d: "ready" in text(d, '.node[data-name="b"]'))
    assert not browser.find_element(By.ID, "stale").is_displayed()
    cluster.b.process.send_signal(signal.SIGSTOP)
    try:
        wait_for(browser, "the stale banner", lambda d: d.find_element(By.ID, "stale").is_displayed())
        assert "this node did not answer within 8 s" in text(browser, "#stale")
        assert "stale" in str(browser.find_element(By.ID, "page").get_attribute("class"))
        shot(browser, tmp_path, "stale")
    finally:
        cluster.b.process.send_signal(signal.SIGCONT)
    wait_for(browser, "the banner gone", lambda d: not d.find_element(By.ID, "stale").is_displayed())
