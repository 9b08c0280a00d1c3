"""The MQTT side of a federation: the aggregators' wire encoding and conversation, local device and aggregator
processes, the embedded broker, mosquitto's generated config, enrollment and cgroups. Uses ``server.engine``."""
