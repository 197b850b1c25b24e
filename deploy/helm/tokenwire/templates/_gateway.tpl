{{- define "tokenwire.smgName" -}}
{{- printf "%s-smg" (include "tokenwire.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tokenwire.smgSelectorLabels" -}}
app.kubernetes.io/name: {{ include "tokenwire.name" . }}-smg
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The port of a replica the gateway talks to, from gateway.smg.workerProtocol. */}}
{{- define "tokenwire.smgWorkerPort" -}}
{{- $mode := .Values.gateway.smg.workerProtocol }}
{{- if eq $mode "grpc" }}
{{- .Values.server.grpcPort }}
{{- else if eq $mode "http" }}
{{- if not .Values.server.rest.enabled }}
{{- fail "gateway.smg.workerProtocol http needs server.rest.enabled (the gateway proxies to the REST shim)" }}
{{- end }}
{{- .Values.server.rest.port }}
{{- else }}
{{- fail (printf "gateway.smg.workerProtocol must be grpc or http (got %q)" $mode) }}
{{- end }}
{{- end }}

{{/* Pod labels the endpoint picker reads to choose its vLLM metric mapping. */}}
{{- define "tokenwire.engineTypeLabels" -}}
{{- if .Values.gateway.inferencePool.enabled }}
llm-d.ai/engine-type: vllm
inference.networking.k8s.io/engine-type: vllm
{{- end }}
{{- end }}

{{/* Serve flags the gateway needs on the replicas. */}}
{{- define "tokenwire.gatewayArgs" -}}
{{- if or (and .Values.gateway.smg.enabled (eq .Values.gateway.smg.workerProtocol "grpc")) (and .Values.gateway.inferencePool.enabled (eq .Values.gateway.inferencePool.protocol "grpc")) }}
- --worker-protocol
- vllm
{{- end }}
{{- if and .Values.gateway.smg.enabled (eq .Values.gateway.smg.workerProtocol "grpc") .Values.gateway.smg.kvEvents }}
- --kv-events-config
- {{ dict "enable_kv_cache_events" true "publisher" "null" | toJson | quote }}
{{- end }}
{{- if .Values.gateway.inferencePool.enabled }}
- --metrics-compat
- both
{{- end }}
{{- end }}

{{/* The gateway's own labels: nothing selecting the replicas (Services, ServiceMonitor, PDB) matches them. */}}
{{- define "tokenwire.smgLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tokenwire.smgSelectorLabels" . }}
app.kubernetes.io/component: gateway
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}
