"""What a CONNECT asks and what the gateway grants (``connecting``), without a connection."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from tridentmq_mqtt.connecting import NEVER, Refused, Terms, leaving, negotiate, will_delay_ms
from tridentmq_mqtt.protocol import events as ev
from tridentmq_mqtt.protocol import reason_codes as rc
from tridentmq_mqtt.protocol.packets import V5, V31, V311, Will
from tridentmq_mqtt.protocol.properties import NO_PROPERTIES, Properties
from tridentmq_mqtt.settings import MqttLimitsSection

LIMITS = MqttLimitsSection()
WEEK = 7 * 24 * 3600


def connect(
    version: int = V5,
    client_id: str = "c1",
    *,
    clean_start: bool = True,
    keep_alive: int = 60,
    password: bytes | None = None,
    properties: Properties = NO_PROPERTIES,
) -> ev.Connect:
    return ev.Connect(version, client_id, clean_start, keep_alive, None, password, None, properties)


def terms(event: ev.Connect, limits: MqttLimitsSection = LIMITS) -> Terms:
    result = negotiate(event, limits, lambda: "auto-1")
    assert isinstance(result, Terms), result
    return result


def test_an_empty_client_id_is_assigned_one() -> None:
    assert terms(connect(V5, "")).client_id == "auto-1"
    assert terms(connect(V5, "")).assigned_client_id == "auto-1"
    assert terms(connect(V311, "")).client_id == "auto-1"  # 3.1.1 with clean session 1: allowed
    assert terms(connect(V5, "c1")).assigned_client_id is None


def test_an_empty_client_id_without_a_clean_session_is_refused_in_3_1_1_only() -> None:
    refused = negotiate(connect(V311, "", clean_start=False), LIMITS, lambda: "auto-1")
    assert refused == Refused(rc.CLIENT_IDENTIFIER_NOT_VALID, "an empty client id needs a clean session")
    assert terms(connect(V5, "", clean_start=False)).client_id == "auto-1"  # 5.0: the server assigns one


def test_an_empty_client_id_is_refused_in_3_1_whatever_the_clean_session() -> None:
    """MQTT V3.1: the client id "is between 1 and 23 characters long"; return code 2 refuses it."""
    for clean in (True, False):
        refused = negotiate(connect(V31, "", clean_start=clean), LIMITS, lambda: "auto-1")
        assert refused == Refused(rc.CLIENT_IDENTIFIER_NOT_VALID, "MQTT 3.1 needs a client id")
    assert terms(connect(V31, "c" * 30)).client_id == "c" * 30  # longer than 23: accepted, as later versions do


def test_a_password_that_is_not_utf_8_is_refused_as_a_bad_password() -> None:
    refused = negotiate(connect(password=b"\xff\xfe"), LIMITS, lambda: "auto-1")
    assert isinstance(refused, Refused)
    assert refused.reason_code == rc.BAD_USER_NAME_OR_PASSWORD
    assert terms(connect(password="pässwort".encode())).password == "pässwort"
    assert terms(connect()).password is None


def test_session_expiry_3_1_1_persistent_sessions_ask_for_never_and_get_the_maximum() -> None:
    persistent = terms(connect(V311, clean_start=False))
    assert (persistent.asked_expiry_s, persistent.expiry_s) == (NEVER, WEEK)
    clean = terms(connect(V311, clean_start=True))
    assert (clean.asked_expiry_s, clean.expiry_s) == (0, 0)
    assert persistent.properties is NO_PROPERTIES  # 3.1.1 has no CONNACK properties


def test_a_5_0_session_expiry_above_the_maximum_is_capped_and_the_connack_says_so() -> None:
    capped = terms(connect(properties=Properties(session_expiry_interval=NEVER)))
    assert capped.expiry_s == WEEK
    assert capped.properties.session_expiry_interval == WEEK
    within = terms(connect(properties=Properties(session_expiry_interval=3600)))
    assert within.expiry_s == 3600
    assert within.properties is NO_PROPERTIES  # granted as asked: nothing to say
    assert terms(connect()).expiry_s == 0  # absent: the session ends with the connection


def test_the_server_keep_alive_replaces_none_or_a_longer_one_when_a_maximum_is_set() -> None:
    assert terms(connect(keep_alive=0)).server_keep_alive is None  # no maximum by default
    limited = replace(LIMITS, max_keep_alive_s=120)
    assert terms(connect(keep_alive=60), limited).server_keep_alive is None
    assert terms(connect(keep_alive=120), limited).server_keep_alive is None
    assert terms(connect(keep_alive=121), limited).server_keep_alive == 120
    assert terms(connect(keep_alive=0), limited).server_keep_alive == 120  # "none" is longer than any
    assert terms(connect(V311, keep_alive=0), limited).server_keep_alive is None  # 3.1.1 cannot be told


def test_response_information_is_the_prefix_and_the_client_id_when_asked_for() -> None:
    asking = Properties(request_response_information=True)
    assert terms(connect(client_id="dev-7", properties=asking)).properties.response_information == "reply/dev-7"
    assert terms(connect(client_id="dev-7")).properties is NO_PROPERTIES  # not asked
    assert terms(connect(properties=asking), replace(LIMITS, response_information_prefix="")).properties is (
        NO_PROPERTIES
    )
    # A client id no topic can hold gives no response information.
    for client_id in ("a+b", "a#", "a\x00b"):
        assert terms(connect(client_id=client_id, properties=asking)).properties is NO_PROPERTIES


def test_a_will_waits_its_delay_but_never_longer_than_the_session_lasts() -> None:
    will = Will("t", b"gone", properties=Properties(will_delay_interval=30))
    assert will_delay_ms(will, 3600) == 30_000
    assert will_delay_ms(will, 10) == 10_000
    assert will_delay_ms(will, 0) == 0
    assert will_delay_ms(Will("t", b"gone"), 3600) == 0


@given(
    version=st.sampled_from([3, V311, V5]),
    client_id=st.sampled_from(["", "c", "a+b"]),
    clean_start=st.booleans(),
    keep_alive=st.integers(0, 0xFFFF),
    expiry=st.one_of(st.none(), st.integers(0, NEVER)),
    max_keep_alive=st.integers(0, 0xFFFF),
    max_expiry=st.integers(0, NEVER),
)
def test_granted_terms_stay_within_the_limits(
    version: int,
    client_id: str,
    clean_start: bool,
    keep_alive: int,
    expiry: int | None,
    max_keep_alive: int,
    max_expiry: int,
) -> None:
    limits = replace(LIMITS, max_keep_alive_s=max_keep_alive, max_session_expiry_s=max_expiry)
    event = connect(
        version,
        client_id,
        clean_start=clean_start,
        keep_alive=keep_alive,
        properties=(Properties(session_expiry_interval=expiry) if version == V5 else NO_PROPERTIES),
    )
    result = negotiate(event, limits, lambda: "auto-1")
    if isinstance(result, Refused):  # an empty client id: in 3.1 always, in 3.1.1 without a clean session
        assert client_id == ""
        assert version == V31 or (version == V311 and not clean_start)
        return
    assert result.expiry_s == min(result.asked_expiry_s, max_expiry)
    assert result.client_id
    if result.server_keep_alive is not None:
        assert version == V5
        assert result.server_keep_alive == max_keep_alive
    if version != V5:
        assert result.properties is NO_PROPERTIES
    elif result.expiry_s != result.asked_expiry_s:
        assert result.properties.session_expiry_interval == result.expiry_s


def test_a_disconnect_that_sets_no_expiry_changes_nothing() -> None:
    assert leaving(None, LIMITS) is None


def test_a_disconnect_may_change_the_expiry_within_the_maximum() -> None:
    assert leaving(60, LIMITS) == 60
    assert leaving(0, LIMITS) == 0  # the session ends with the connection
    assert leaving(NEVER, LIMITS) == WEEK
    assert leaving(60, replace(LIMITS, max_session_expiry_s=0)) == 0
