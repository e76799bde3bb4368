"""The service's transports: its messages over HTTP and Ray, and a server started in its own process."""
