"""Built-in backends. Each module is a plugin written exactly as a third party would write one."""
