"""The sessions page (``/ui``): what the server did to each agent's context, for a person to look at."""
