{{- define "tokenwire.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tokenwire.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tokenwire.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tokenwire.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tokenwire.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tokenwire.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "tokenwire.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tokenwire.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tokenwire.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s%s" .Chart.AppVersion (ternary "" "-cpu" .Values.gpu.enabled)) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* Secret names: the operator's own, or the one this chart creates. */}}
{{- define "tokenwire.tlsSecretName" -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "tokenwire.fullname" .)) }}
{{- end }}

{{- define "tokenwire.tenantsSecretName" -}}
{{- .Values.tenants.existingSecret | default (printf "%s-tenants" (include "tokenwire.fullname" .)) }}
{{- end }}

{{/* Where the Secrets are mounted (whole-directory mounts, so Secret updates reach the files). */}}
{{- define "tokenwire.tlsDir" -}}/etc/tokenwire/tls{{- end }}
{{- define "tokenwire.tenantsDir" -}}/etc/tokenwire/tenants{{- end }}

{{- define "tokenwire.tlsServerName" -}}
{{- .Values.tls.serverName | default (printf "%s.%s.svc" (include "tokenwire.fullname" .) .Release.Namespace) }}
{{- end }}

{{- define "tokenwire.clientCertReqs" -}}
{{- $reqs := .Values.tls.clientCertReqs | default "none" }}
{{- if not (has $reqs (list "none" "optional" "required")) }}
{{- fail (printf "tls.clientCertReqs must be none, optional or required (got %q)" $reqs) }}
{{- end }}
{{- $reqs }}
{{- end }}

{{/*
terminationGracePeriodSeconds: preStop sleep + --shutdown-timeout (rounded up) + a margin for
the engine shutdown and the final server stop. Always above --shutdown-timeout.
*/}}
{{- define "tokenwire.terminationGracePeriodSeconds" -}}
{{- $shutdown := int (ceil .Values.server.shutdownTimeoutSeconds) }}
{{- $extra := int .Values.server.terminationGraceExtraSeconds }}
{{- if lt $extra 1 }}
{{- fail "server.terminationGraceExtraSeconds must be at least 1" }}
{{- end }}
{{- add (int .Values.server.preStopSleepSeconds) $shutdown $extra }}
{{- end }}

{{/* The container's arguments to `tokenwire serve`. */}}
{{- define "tokenwire.args" -}}
{{- if .Values.model }}
- {{ .Values.model | quote }}
{{- end }}
- --host
- 0.0.0.0
- --grpc-port
- {{ .Values.server.grpcPort | quote }}
{{- if .Values.server.rest.enabled }}
- --port
- {{ .Values.server.rest.port | quote }}
{{- else }}
- --disable-rest
{{- end }}
{{- if .Values.servedModelName }}
- --served-model-name
- {{ .Values.servedModelName | quote }}
{{- end }}
- --device
- {{ ternary "cuda" "cpu" .Values.gpu.enabled }}
- --shutdown-timeout
- {{ .Values.server.shutdownTimeoutSeconds | quote }}
- --log-format
- {{ .Values.server.logFormat | quote }}
{{- if .Values.metrics.enabled }}
- --metrics-port
- {{ .Values.metrics.port | quote }}
{{- end }}
{{- if gt (int .Values.server.maxConnectionAgeSeconds) 0 }}
- --grpc-max-connection-age
- {{ .Values.server.maxConnectionAgeSeconds | quote }}
{{- end }}
{{- if gt (int .Values.server.maxConnectionAgeGraceSeconds) 0 }}
- --grpc-max-connection-age-grace
- {{ .Values.server.maxConnectionAgeGraceSeconds | quote }}
{{- end }}
{{- if .Values.tls.enabled }}
- --ssl-certfile
- {{ include "tokenwire.tlsDir" . }}/tls.crt
- --ssl-keyfile
- {{ include "tokenwire.tlsDir" . }}/tls.key
{{- if ne (include "tokenwire.clientCertReqs" .) "none" }}
- --ssl-ca-certs
- {{ include "tokenwire.tlsDir" . }}/ca.crt
- --ssl-cert-reqs
- {{ include "tokenwire.clientCertReqs" . }}
{{- end }}
{{- end }}
{{- if .Values.tenants.enabled }}
- --api-key-file
- {{ include "tokenwire.tenantsDir" . }}/{{ .Values.tenants.key }}
{{- end }}
{{- if and (or .Values.tls.enabled .Values.tenants.enabled) (gt (float64 .Values.server.reloadIntervalSeconds) 0.0) }}
- --reload-interval
- {{ .Values.server.reloadIntervalSeconds | quote }}
{{- end }}
{{- include "tokenwire.gatewayArgs" . }}
{{- range .Values.server.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/*
A probe's action. Plaintext: the kubelet's native gRPC probe on grpc.health.v1. TLS: the
kubelet cannot speak TLS to a gRPC probe, so the container runs the same Check through
deploy/grpc_health_check.py, trusting the server certificate (and ca.crt), presenting it as
client certificate under mTLS.
*/}}
{{- define "tokenwire.probeAction" -}}
{{- if .Values.tls.enabled }}
exec:
  command:
    - python
    - /opt/tokenwire/grpc_health_check.py
    - --port
    - {{ .Values.server.grpcPort | quote }}
    - --tls-server-name
    - {{ include "tokenwire.tlsServerName" . }}
    - --tls-ca
    - {{ include "tokenwire.tlsDir" . }}/tls.crt
{{- if ne (include "tokenwire.clientCertReqs" .) "none" }}
    - --tls-ca
    - {{ include "tokenwire.tlsDir" . }}/ca.crt
{{- end }}
{{- if eq (include "tokenwire.clientCertReqs" .) "required" }}
    - --tls-cert
    - {{ include "tokenwire.tlsDir" . }}/tls.crt
    - --tls-key
    - {{ include "tokenwire.tlsDir" . }}/tls.key
{{- end }}
{{- else }}
grpc:
  port: {{ .Values.server.grpcPort }}
{{- end }}
{{- end }}

{{- define "tokenwire.resources" -}}
{{- $profile := ternary .Values.gpuProfile.resources .Values.cpuProfile.resources .Values.gpu.enabled }}
{{- $res := deepCopy (.Values.resources | default $profile) }}
{{- if .Values.gpu.enabled }}
{{- $limits := $res.limits | default dict }}
{{- $_ := set $limits "nvidia.com/gpu" (int .Values.gpu.count) }}
{{- $_ := set $res "limits" $limits }}
{{- end }}
{{- toYaml $res }}
{{- end }}
