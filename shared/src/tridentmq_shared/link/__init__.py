"""The internal link: gateway ↔ core and core ↔ core, one binary protocol (sans-IO codec + asyncio client)."""
