"""TridentMQ shared library: message model, internal link, settings, logging and the CLI."""
