"""The MQTT 5 reason codes the codec itself raises or validates (the full list is in section 2.4 of 5.0)."""

from __future__ import annotations

from typing import Final

SUCCESS: Final = 0x00
UNSPECIFIED_ERROR: Final = 0x80
MALFORMED_PACKET: Final = 0x81
PROTOCOL_ERROR: Final = 0x82
UNSUPPORTED_PROTOCOL_VERSION: Final = 0x84
TOPIC_FILTER_INVALID: Final = 0x8F
TOPIC_NAME_INVALID: Final = 0x90
PACKET_TOO_LARGE: Final = 0x95
