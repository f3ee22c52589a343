"""The sans-IO MQTT 3.1/3.1.1/5.0 codec: packets, their encoder and an incremental parser."""
