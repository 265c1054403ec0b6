"""The pure core: schedule, schema, codec, outer step and statistics. No I/O here."""
