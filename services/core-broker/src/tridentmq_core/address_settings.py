"""Artemis-style address settings: per-address behaviour resolved from wildcard entries.

The most specific matching entry wins field by field; unset fields fall through to less specific
entries and finally to ``BUILT_IN``. Resolution is cached per address; an operator's change at run time
(``set_entry``) clears the cache.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tridentmq_core.router import InvalidAddress, pattern_matches, validate_address
from tridentmq_core.settings import AddressSettingsEntry
from tridentmq_shared.message import TEMPORARY_ADDRESS_PREFIX, RoutingType
from tridentmq_shared.settings import SettingsError


@dataclass(frozen=True, slots=True)
class ResolvedAddressSettings:
    dead_letter_address: str | None = "DLQ"
    expiry_address: str | None = "ExpiryQueue"
    max_delivery_attempts: int = 10
    redelivery_delay_ms: int = 0
    redelivery_multiplier: float = 1.0
    max_redelivery_delay_ms: int = 60_000
    auto_create_addresses: bool = True
    auto_create_queues: bool = True
    auto_delete_queues: bool = True
    auto_delete_addresses: bool = True
    auto_delete_addresses_delay_ms: int = 0
    auto_create_dead_letter_resources: bool = True
    default_routing_type: RoutingType = RoutingType.ANYCAST
    max_size_bytes: int = -1
    address_full_policy: str = "PAGE"
    redistribution_delay_ms: int = 1000

    def redelivery_delay(self, attempts: int) -> int:
        """Delay in ms before redelivery number ``attempts`` (1 = first redelivery)."""
        if self.redelivery_delay_ms <= 0:
            return 0
        try:
            # As a float: a whole multiplier from a settings file would make an exact integer of millions of digits.
            delay = self.redelivery_delay_ms * float(self.redelivery_multiplier) ** max(0, attempts - 1)
        except OverflowError:  # a thousand attempts of a message that is never dead-lettered
            return self.max_redelivery_delay_ms
        return int(min(delay, self.max_redelivery_delay_ms))


BUILT_IN = ResolvedAddressSettings()
#: Entries that apply unless configured otherwise for the same pattern.
BUILT_IN_ENTRIES = (AddressSettingsEntry(match=TEMPORARY_ADDRESS_PREFIX + "#", auto_create_queues=False),)


def _specificity(pattern: str) -> tuple[int, int, int]:
    """Fewer wildcards, then more literal words, then longer: more specific (Artemis' rule in spirit)."""
    words = pattern.split(".")
    hashes = words.count("#")
    stars = words.count("*")
    return (-hashes, -stars, len(words) - hashes - stars)


FULL_POLICIES = ("PAGE", "BLOCK", "FAIL", "DROP")


#: The least value of each numeric setting (-1 where it means "never" or "no limit").
_MINIMUMS = {
    "max_delivery_attempts": -1,
    "redelivery_delay_ms": 0,
    "max_redelivery_delay_ms": 0,
    "auto_delete_addresses_delay_ms": 0,
    "max_size_bytes": -1,
    "redistribution_delay_ms": -1,
}


def check_entry(entry: AddressSettingsEntry) -> None:
    """``SettingsError`` for a value no address may have: a configured entry and one an operator sets at run
    time are checked alike (a NaN multiplier once made every nack of its addresses raise)."""
    where = f"address_settings {entry.match!r}"
    try:
        validate_address(entry.match, allow_wildcards=True)
    except InvalidAddress as exc:  # "" matched no address: its settings applied nowhere, silently
        raise SettingsError(f"{where}: match is an address or a pattern (# for every address): {exc}") from None
    policy = entry.address_full_policy
    if policy is not None and policy.upper() not in FULL_POLICIES:
        raise SettingsError(f"{where}: address_full_policy {policy!r} is not one of {', '.join(FULL_POLICIES)}")
    routing = entry.default_routing_type
    if routing is not None and routing.lower() not in ("anycast", "multicast"):
        raise SettingsError(f"{where}: default_routing_type is anycast or multicast, not {routing!r}")
    for key, least in _MINIMUMS.items():
        value = getattr(entry, key)
        if value is not None and value < least:
            raise SettingsError(f"{where}: {key} is at least {least}")
    multiplier = entry.redelivery_multiplier
    if multiplier is not None and not (math.isfinite(multiplier) and multiplier >= 1.0):
        raise SettingsError(f"{where}: redelivery_multiplier is a number of at least 1.0")
    for key in ("dead_letter_address", "expiry_address"):
        address = getattr(entry, key)
        if address:  # "" drops the message
            try:
                validate_address(address, allow_wildcards=False)
            except InvalidAddress as exc:
                raise SettingsError(f"{where}: {key}: {exc}") from None


class AddressSettingsRepository:
    def __init__(self, entries: Sequence[AddressSettingsEntry]) -> None:
        for entry in entries:
            check_entry(entry)
        self._configured = list(entries)
        self._entries: list[AddressSettingsEntry] = []
        self._cache: dict[str, ResolvedAddressSettings] = {}
        # Addresses matched by the same entries share one resolved object: 100,000 device topics are one.
        self._combined: dict[tuple[int, ...], ResolvedAddressSettings] = {}
        self._sort()

    def _sort(self) -> None:
        # Configured entries first: among equally specific patterns the first one found wins.
        entries = [*self._configured, *BUILT_IN_ENTRIES]
        self._entries = sorted(entries, key=lambda e: _specificity(e.match), reverse=True)
        self._cache.clear()
        self._combined.clear()

    @property
    def entries(self) -> list[AddressSettingsEntry]:
        """The configured entries (with changes made at run time), in the order they were given."""
        return list(self._configured)

    def set_entry(self, entry: AddressSettingsEntry) -> None:
        """Add the entry for ``entry.match``, or replace the one there is (a change at run time, not saved)."""
        check_entry(entry)
        matches = [e.match for e in self._configured]
        if entry.match in matches:
            self._configured[matches.index(entry.match)] = entry  # keeps its place among equally specific ones
        else:
            self._configured.append(entry)
        self._sort()

    def resolve(self, address: str) -> ResolvedAddressSettings:
        found = self._cache.get(address)
        if found is not None:
            return found
        matched = tuple(i for i, entry in enumerate(self._entries) if pattern_matches(entry.match, address))
        resolved = self._combined.get(matched)
        if resolved is None:
            resolved = self._combined[matched] = self._combine([self._entries[i] for i in matched])
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[address] = resolved
        return resolved

    @staticmethod
    def _combine(entries: list[AddressSettingsEntry]) -> ResolvedAddressSettings:
        """The settings of the given entries, most specific first, over the built-in defaults."""
        values: dict[str, object] = {}
        for entry in entries:
            for f in dataclasses.fields(entry):
                value = getattr(entry, f.name)
                if f.name != "match" and value is not None and f.name not in values:
                    values[f.name] = value
        if "address_full_policy" in values:
            values["address_full_policy"] = str(values["address_full_policy"]).upper()
        routing = values.pop("default_routing_type", None)
        resolved = dataclasses.replace(BUILT_IN, **values)  # type: ignore[arg-type]
        if routing is not None:
            resolved = dataclasses.replace(resolved, default_routing_type=RoutingType[str(routing).upper()])
        return resolved
