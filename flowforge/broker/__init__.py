"""RabbitMQ: topology, message format, the confirming publisher and the consumer (pika)."""
