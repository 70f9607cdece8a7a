"""The servers: the text-only SGLang capture server's command line, environment and Mooncake settings, the CPU
reference capture server, and the loopback-address rules every listener follows.
"""
