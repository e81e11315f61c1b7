// Drives hermes-env mcp with the TypeScript MCP SDK's client; prints one JSON line of what it saw.
// usage: node client.mjs stdio PYTHON WORKDIR | node client.mjs http URL WORKDIR  (token in $MCP_TOKEN)
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { LoggingMessageNotificationSchema } from "@modelcontextprotocol/sdk/types.js";

const [mode, a, workdir] = process.argv.slice(2);
let transport;
if (mode === "stdio") {
  transport = new StdioClientTransport({
    command: a, args: ["-m", "hermes_env_core.cli", "mcp"], cwd: workdir,
    env: { ...process.env, TERMINAL_ENV: "local" }, stderr: "inherit",
  });
} else {
  transport = new StreamableHTTPClientTransport(new URL(a), {
    requestInit: { headers: { Authorization: `Bearer ${process.env.MCP_TOKEN}` } },
  });
}
const client = new Client({ name: "hermes-env-ts-test", version: "1.0.0" });
const logs = [];
client.setNotificationHandler(LoggingMessageNotificationSchema, (n) => { logs.push(n.params.data); });
await client.connect(transport);

const out = { server: client.getServerVersion()?.name };
out.tools = (await client.listTools()).tools.map((t) => t.name).sort();
const cd = `cd '${workdir.replaceAll("'", "'\\''")}'`;
await client.callTool({ name: "run", arguments: { command: `export TS_VAR=from-typescript; ${cd}` } });
const second = await client.callTool({ name: "run", arguments: { command: "echo $TS_VAR; pwd; echo done" } });
out.second = second.structuredContent;
const bad = await client.callTool({ name: "run", arguments: { command: 42 } });
out.bad = { isError: bad.isError, text: bad.content[0].text };
const spawned = await client.callTool({
  name: "spawn", arguments: { command: "echo warming; echo READY-TS; sleep 0.2; exit 4", watch: ["READY-TS"] },
});
const id = spawned.structuredContent.id;
out.wait1 = (await client.callTool({ name: "process_wait", arguments: { id, timeout: 20 } })).structuredContent;
out.wait2 = (await client.callTool({ name: "process_wait", arguments: { id, timeout: 20 } })).structuredContent;
await client.callTool({ name: "write_file", arguments: { path: "ts-file.txt", content: "typed\n" } });
out.read = (await client.callTool({ name: "read_file", arguments: { path: "ts-file.txt" } })).structuredContent;
// Log messages for the background process arrive on their own; give them a bounded moment.
for (let i = 0; i < 100 && !logs.some((d) => d && d.event === "exit"); i++) {
  await new Promise((r) => setTimeout(r, 50));
}
out.logs = logs;
await client.close();
console.log(JSON.stringify(out));
