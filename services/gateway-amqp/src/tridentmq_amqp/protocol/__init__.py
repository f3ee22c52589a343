"""The AMQP 1.0 side of the gateway without I/O: the type system, the SASL layer in front of proton, and
the proton engine wrapped as bytes in, events out."""
